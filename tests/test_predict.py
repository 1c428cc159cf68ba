"""tools/predict.py and squad.deploy (issue 14): any squad model on image files of any size and mode, a readable
picture and the raw values per task, Taskonomy's own encodings, unreadable files reported and skipped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import squad
from squad.config.tools import InferenceOptions, PredictConfig
from squad.data.taskonomy import read_raw
from squad.data.transforms import SamplePipeline
from squad.deploy.encode import TASKONOMY_ENCODERS, encode_taskonomy
from squad.deploy.pictures import picture, save_png
from squad.deploy.predict import list_images, load_image, predict
from squad.io import export_model
from squad.models.inference import set_inference
from squad.models.usage import ExpertUsage
from squad.tasks import TASK_NAMES, get_task
from tests.helpers import ROOT, randomize_routers, tiny_config, tiny_model

DENSE = [t for t in TASK_NAMES if get_task(t).head_kind == "dense"]
HEADS = ["depth_euclidean", "normal", "principal_curvature", "segment_unsup2d", "class_scene"]
GOOD = ["a_odd", "b_tall", "grey", "rgba", "sixteen"]  # the readable images of `image_dir`, sorted by file name


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Images of odd sizes and modes, one corrupt PNG and one text file (which a folder scan ignores)."""
    d = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).save(d / "a_odd.png")
    Image.fromarray(rng.integers(0, 256, (61, 40, 3), dtype=np.uint8)).save(d / "b_tall.jpg", quality=90)
    Image.fromarray(rng.integers(0, 256, (30, 30), dtype=np.uint8)).save(d / "grey.png")
    Image.fromarray(rng.integers(0, 256, (33, 45, 4), dtype=np.uint8)).save(d / "rgba.png")
    Image.fromarray(rng.integers(0, 65536, (40, 40), dtype=np.uint16)).save(d / "sixteen.png")
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(64)))
    (d / "notes.txt").write_text("not an image")
    return d


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder with a tiny MoE model (MoE attention + MoE MLP, then a MoD block) and its saved usage."""
    model = tiny_model(HEADS)
    usage = ExpertUsage(model.task_names)
    with torch.no_grad():
        usage.update(model(torch.rand(4, 3, 32, 32)).stats)
    run = tmp_path_factory.mktemp("run")
    export_model(run / "model.pt", model, usage, {"step": 1, "trained_tasks": HEADS})
    return run


def _forward(model, image: torch.Tensor, task: str) -> np.ndarray:
    """The model's own prediction in task units for one preprocessed image."""
    inner = getattr(model, "model", model)
    with torch.no_grad():
        pred = inner(image[None], [task]).preds[task]
    return get_task(task).to_units(pred)[0].numpy()


# ----------------------------------------------------------------------------------------------------------- images
def test_images_are_prepared_as_the_evaluation_prepares_them(image_dir, tmp_path):
    rng = np.random.default_rng(1)
    square = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)
    Image.fromarray(square).save(tmp_path / "sq.png")
    x, info = load_image(tmp_path / "sq.png", 32)
    expected, _, _ = SamplePipeline([], image_size=32)({"rgb": read_raw(tmp_path / "sq.png")}, None)
    assert torch.equal(x, expected) and info["crop"] == [0, 0, 48]  # exactly tools/evaluate.py's input
    # non-square: the centred square, then the same resize
    x, info = load_image(image_dir / "a_odd.png", 32)
    assert info == {"size": [37, 53], "crop": [0, 8, 37], "mode": "RGB"}
    raw = read_raw(image_dir / "a_odd.png")[:, 8:45]
    assert torch.equal(x, SamplePipeline([], image_size=32)({"rgb": raw}, None)[0])
    # grey → three equal channels; RGBA → alpha dropped; 16-bit → ÷257
    g, _ = load_image(image_dir / "grey.png", 32)
    assert g.shape == (3, 32, 32) and torch.equal(g[0], g[1]) and torch.equal(g[1], g[2])
    rgba, _ = load_image(image_dir / "rgba.png", 32)
    raw = read_raw(image_dir / "rgba.png")[:, 6:39, :3]
    assert torch.equal(rgba, SamplePipeline([], image_size=32)({"rgb": raw}, None)[0])
    s16, info = load_image(image_dir / "sixteen.png", 32)
    as8 = np.round(read_raw(image_dir / "sixteen.png") / 257.0).astype(np.uint8)
    assert info["size"] == [40, 40] and torch.equal(s16, SamplePipeline([], image_size=32)({"rgb": as8}, None)[0])
    # a JPEG's EXIF orientation is applied (a phone photo taken upright stays upright)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    Image.fromarray(rng.integers(0, 256, (20, 50, 3), dtype=np.uint8)).save(tmp_path / "rot.jpg", exif=exif)
    _, info = load_image(tmp_path / "rot.jpg", 32)
    assert info["size"] == [50, 20]


def test_folders_are_scanned_for_images_and_missing_paths_refused(image_dir, tmp_path):
    files = list_images([image_dir])
    assert [f.name for f in files] == ["a_odd.png", "b_tall.jpg", "corrupt.png", "grey.png", "rgba.png",
                                       "sixteen.png"]  # sorted, notes.txt left out
    assert list_images([image_dir / "grey.png", image_dir])[0].name == "grey.png"  # each once, in order given
    with pytest.raises(FileNotFoundError, match="nope.png"):
        list_images([image_dir / "nope.png"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        list_images([tmp_path / "empty"])


# ------------------------------------------------------------------------------------------------------- full model
def test_predict_on_a_full_model_writes_pictures_and_exact_values(run_dir, image_dir, tmp_path, load_tool, capsys):
    out = tmp_path / "pred"
    tool = load_tool("tools/predict.py")
    code = tool.main(["--checkpoint", str(run_dir), "--images", str(image_dir), "--out", str(out), "--batch-size",
                      "2", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1, captured.err  # one file skipped
    assert "corrupt.png" in captured.err and "not an image" in captured.err
    summary = json.loads((out / "predictions.json").read_text())
    assert [e["out"] for e in summary["images"]] == GOOD and summary["tasks"] == HEADS
    assert [s["path"] for s in summary["skipped"]] == [str(image_dir / "corrupt.png")]
    assert "notes.txt" not in json.dumps(summary)
    model = squad.load(run_dir)
    for entry in summary["images"]:
        folder = out / entry["out"]
        image, _ = load_image(entry["path"], 32)
        for task in ["depth_euclidean", "normal", "principal_curvature", "segment_unsup2d"]:
            channels = get_task(task).channels
            with Image.open(folder / f"{task}.png") as pic:
                pic.verify()
            with Image.open(folder / f"{task}.png") as pic:
                assert pic.size == (32, 32) and pic.mode in ("L", "RGB")
            values = np.load(folder / f"{task}.npy")
            assert values.shape == (channels, 32, 32) and values.dtype == np.float32
            np.testing.assert_allclose(values, _forward(model, image, task), atol=1e-5, rtol=1e-6)
        top = json.loads((folder / "class_scene.json").read_text())["top5"]
        probs = np.load(folder / "class_scene.npy")
        assert probs.shape == (365,) and abs(probs.sum() - 1) < 1e-4
        np.testing.assert_allclose(probs, _forward(model, image, "class_scene"), atol=1e-5, rtol=1e-6)
        assert [t["index"] for t in top] == np.argsort(-probs, kind="stable")[:5].tolist()
        assert top == entry["top5"]["class_scene"]
    assert f"{summary['images'][0]['out']} class_scene: class" in captured.out


def test_predict_writes_taskonomy_encodings_that_decode_back(run_dir, image_dir, tmp_path, load_tool, capsys):
    out = tmp_path / "enc"
    args = ["--checkpoint", str(run_dir), "--images", str(image_dir / "grey.png"), str(image_dir / "a_odd.png"),
            "--out", str(out), "--tasks", "depth", "normal,curvature", "segment2d", "scene", "--encode", "taskonomy"]
    assert load_tool("tools/predict.py").main(args) == 0, capsys.readouterr().err
    model = squad.load(run_dir)
    image, _ = load_image(image_dir / "grey.png", 32)
    folder = out / "grey"
    for task in ["depth_euclidean", "normal", "principal_curvature", "segment_unsup2d"]:
        assert not (folder / f"{task}.npy").exists()
        spec = get_task(task)
        value, mask = spec.decode(read_raw(folder / f"{task}_taskonomy.png"))
        code = 1 / 127.5 if task == "normal" else spec.spec.code_scale if task != "depth_euclidean" else 1 / 512
        expected = _forward(model, image, task)
        assert mask.all()
        tol = 1.5 * code if task == "normal" else 0.5 * code + 1e-6  # normals: renormalised after rounding
        np.testing.assert_allclose(value.numpy(), expected, atol=tol, rtol=0)
    assert np.load(folder / "class_scene.npy").shape == (365,)  # class tasks: Taskonomy's own .npy


@pytest.mark.parametrize("task", DENSE)
def test_every_encoding_round_trips_through_the_task_decode(task, tmp_path):
    spec = get_task(task)
    rng = np.random.default_rng(0)
    shape = (spec.channels, 9, 11)
    if task == "normal":
        v = rng.normal(size=shape)
        v /= np.linalg.norm(v, axis=0, keepdims=True)
    else:
        code = 1 / 512 if task.startswith("depth") else spec.spec.code_scale
        top = (2**spec.bits - 2) * code + (0 if task.startswith("depth") else spec.spec.code_offset)
        low = 0.0 if task.startswith("depth") else spec.spec.code_offset
        v = rng.uniform(low, top, size=shape)
    encoded = encode_taskonomy(task, v)
    path = save_png(tmp_path / f"{task}.png", encoded)
    value, mask = spec.decode(read_raw(path))
    assert mask.all()
    if task == "normal":  # each axis within one code before renormalising, 1.5 codes after
        raw = read_raw(path).astype(np.float64).transpose(2, 0, 1) / 127.5 - 1
        assert np.abs(raw - v).max() <= 0.5 / 127.5 + 1e-9
        assert np.abs(value.numpy() - v).max() <= 1.5 / 127.5
    else:
        assert np.abs(value.numpy() - v).max() <= 0.5 * code + 1e-6  # rounding: half a code
    # out-of-range values clip to the file's range; never the invalid code
    if task.startswith("depth"):
        far = encode_taskonomy(task, np.full((1, 2, 2), 500.0))
        assert far.dtype == np.uint16 and (far == 65534).all()
    assert set(TASKONOMY_ENCODERS) == set(DENSE)


def test_pictures_are_readable_images_for_every_task():
    rng = np.random.default_rng(0)
    for task in DENSE:
        pic = picture(task, get_task(task).to_units(torch.randn(1, get_task(task).channels, 8, 8))[0].numpy())
        assert pic.dtype == np.uint8 and pic.shape[:2] == (8, 8) and pic.ndim in (2, 3)
        assert pic.max() > pic.min(), task  # not a blank picture
    assert picture("my_head", rng.normal(size=(3, 4, 4))).shape == (4, 4, 3)  # a head outside Taskonomy
    assert picture("my_head", rng.normal(size=(1, 4, 4))).shape == (4, 4, 3)
    # edges grey over the range the target covers: none → black, the top of the range → white
    edges = picture("edge_occlusion", np.array([[[0.0, 0.003125, 0.00625, 0.1]]]))
    assert edges.tolist() == [[0, 128, 255, 255]]
    assert picture("edge_texture", np.array([[[0.0, 0.08]]])).tolist() == [[0, 255]]
    # depth: near is brighter than far; normals: Taskonomy's RGB; segments: one colour per id
    near_far = picture("depth", np.array([[[1.0, 2.0, 3.0, 8.0]]])).astype(int).sum(-1)[0]
    assert near_far[0] > near_far[1] > near_far[2] > near_far[3]
    assert picture("normal", np.array([[[0.0]], [[0.0]], [[1.0]]])).tolist() == [[[128, 128, 255]]]
    seg = picture("segment_unsup2d", np.array([[[3.0, 3.2, 4.0]]]))
    assert (seg[0, 0] == seg[0, 1]).all() and (seg[0, 0] != seg[0, 2]).any()


# ------------------------------------------------------------------------------------------------ other model kinds
def test_predict_on_an_extracted_model(run_dir, image_dir, tmp_path, load_tool, capsys):
    ext_file = tmp_path / "depth.pt"
    extract = load_tool("tools/extract.py")
    assert extract.main(["--checkpoint", str(run_dir), "--task", "depth", "--saved-usage", "--theta", "0.2",
                         "--eval-split", "none", "--out", str(ext_file)]) == 0, capsys.readouterr().err
    ext = squad.load_extracted(ext_file)
    assert ext.kept  # experts were pruned
    out = tmp_path / "pred"
    tool = load_tool("tools/predict.py")
    capsys.readouterr()
    assert tool.main(["--checkpoint", str(ext_file), "--images", str(image_dir / "b_tall.jpg"), "--out",
                      str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (out / "b_tall").iterdir()) == ["depth_euclidean.npy", "depth_euclidean.png"]
    image, _ = load_image(image_dir / "b_tall.jpg", 32)
    with torch.no_grad():
        expected = get_task("depth").to_units(ext(image[None]))[0].numpy()
    np.testing.assert_allclose(np.load(out / "b_tall" / "depth_euclidean.npy"), expected, atol=1e-5, rtol=1e-6)
    # a task the extracted model lacks: exit 2, naming the task it has
    assert tool.main(["--checkpoint", str(ext_file), "--images", str(image_dir), "--out", str(out),
                      "--tasks", "normal"]) == 2
    err = capsys.readouterr().err
    assert "'normal'" in err and "depth_euclidean" in err


@pytest.mark.parametrize("kind", ["mone_vit_s", "mod_vit_s"])
def test_predict_on_mone_and_mod_models(kind, image_dir, tmp_path, capsys):
    cfg = tiny_config(ROOT / "configs" / "model" / f"{kind}.yaml", ["model.heads=[depth_euclidean,normal]",
                                                                    "model.depth=2"])
    torch.manual_seed(0)
    model = squad.build_model(cfg.model)
    randomize_routers(model, 0)
    export_model(tmp_path / "m.pt", model.eval(), None)
    settings = {"mone_capacity": 0.5} if kind.startswith("mone") else {"mod_inference": "topk"}
    cfg = PredictConfig(tasks=["normal"], batch_size=2, device="cpu", inference=InferenceOptions(**settings))
    summary = predict(squad.load(tmp_path / "m.pt"), [image_dir / "rgba.png", image_dir / "grey.png"], tmp_path / "out",
                      cfg, progress=True)
    assert summary["inference"].items() >= settings.items()
    assert "2/2" in capsys.readouterr().err  # the progress bar, on stderr
    set_inference(model, **settings)
    for entry in summary["images"]:
        image, _ = load_image(entry["path"], 32)
        np.testing.assert_allclose(np.load(tmp_path / "out" / entry["out"] / "normal.npy"),
                                   _forward(model, image, "normal"), atol=1e-5, rtol=1e-6)
    wrong = {"mod_inference": "topk"} if kind.startswith("mone") else {"mone_capacity": 0.5}
    with pytest.raises(ValueError, match="no MoD blocks" if kind.startswith("mone") else "no MoNE blocks"):
        predict(squad.load(tmp_path / "m.pt"), [image_dir], tmp_path / "out2",
                PredictConfig(inference=InferenceOptions(**wrong)))


def test_predict_on_an_adapted_timm_model(image_dir, tmp_path, load_tool, capsys):
    """tools/adapt_pretrained.py's output; its timm classifier head is outside Taskonomy: raw logits, softmax top-5."""
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                            num_classes=7)
    torch.save(vit.state_dict(), tmp_path / "vit.pth")
    adapted = tmp_path / "amod.pt"
    assert load_tool("tools/adapt_pretrained.py").main(["--checkpoint", str(tmp_path / "vit.pth"), "--num-heads",
                                                        "3", "--out", str(adapted)]) == 0
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"thing {i}" for i in range(7)) + "\n")
    out = tmp_path / "pred"
    assert load_tool("tools/predict.py").main(["--checkpoint", str(adapted), "--images", str(image_dir / "grey.png"),
                                               "--out", str(out), "--class-names", f"timm={names}"]) == 0
    logits = np.load(out / "grey" / "timm.npy")
    image, _ = load_image(image_dir / "grey.png", 32)
    model = squad.load(adapted)
    with torch.no_grad():
        np.testing.assert_allclose(logits, model(image[None]).preds["timm"][0].numpy(), atol=1e-5, rtol=1e-6)
    top = json.loads((out / "grey" / "timm.json").read_text())["top5"]
    probs = torch.softmax(torch.from_numpy(logits), 0).numpy()
    assert [t["index"] for t in top] == np.argsort(-probs)[:5].tolist()
    assert top[0]["name"] == f"thing {top[0]['index']}" and abs(top[0]["probability"] - probs.max()) < 1e-6
    captured = capsys.readouterr()
    assert f"grey timm: thing {top[0]['index']}" in captured.out
    assert "1/1" not in captured.err  # no progress bar when stderr is not a terminal
    # class names of the wrong length are bad input
    names.write_text("one\ntwo\n")
    assert load_tool("tools/predict.py").main(["--checkpoint", str(adapted), "--images", str(image_dir), "--out",
                                               str(out), "--class-names", f"timm={names}"]) == 2
    assert "2 names for 7 classes" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- exit codes
def test_bad_input_is_exit_2_and_writes_nothing(run_dir, image_dir, tmp_path, load_tool, capsys):
    tool = load_tool("tools/predict.py")
    out = tmp_path / "never"
    base = {"--checkpoint": str(run_dir), "--images": str(image_dir), "--out": str(out)}
    cases = [  # (the change to the arguments, what the error says)
        ({"--tasks": "sky"}, "unknown task 'sky': this model has depth_euclidean, normal"),
        ({"--images": str(tmp_path / "nope.png")}, str(tmp_path / "nope.png")),
        ({"--images": str(tmp_path)}, "no image files"),
        ({"--batch-size": "0"}, "--batch-size must be >= 1"),
        ({"--checkpoint": str(tmp_path / "missing")}, str(tmp_path / "missing")),
    ]
    for change, message in cases:
        argv = [x for flag, value in {**base, **change}.items() for x in (flag, value)]
        assert tool.main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith("error: ") and message in err, err
    assert not out.exists()  # nothing is created before the inputs are checked
    # every file unreadable: the run still ends cleanly, exit 1, nothing predicted
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    assert tool.main(["--checkpoint", str(run_dir), "--images", str(bad), "--out", str(out), "--quiet"]) == 1
    summary = json.loads((out / "predictions.json").read_text())
    assert summary["images"] == [] and summary["skipped"][0]["path"] == str(bad / "x.jpg")



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_predict_uses_the_gpu_by_default_and_agrees_with_the_cpu(run_dir, image_dir, tmp_path):
    gpu = predict(squad.load(run_dir), [image_dir / "a_odd.png"], tmp_path / "gpu", PredictConfig(["depth", "normal"]))
    cpu = predict(squad.load(run_dir), [image_dir / "a_odd.png"], tmp_path / "cpu",
                  PredictConfig(["depth", "normal"], device="cpu"))
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu"
    for task in ["depth_euclidean", "normal"]:
        np.testing.assert_allclose(np.load(tmp_path / "gpu" / "a_odd" / f"{task}.npy"),
                                   np.load(tmp_path / "cpu" / "a_odd" / f"{task}.npy"), atol=1e-3, rtol=1e-3)
