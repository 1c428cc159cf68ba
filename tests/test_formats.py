"""Models to hand to anyone: Hugging Face-style folders (safetensors + config.json + model card) that `squad.load`
opens without pickle, hub ids resolved from huggingface_hub's cache (offline: a local folder laid out as the cache),
uploads with the library's API (mocked), and ONNX files checked in ONNX Runtime against squad.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import squad
from squad.deploy.export import ExportError
from squad.io import save_extracted
from squad.io.hf_folder import INDEX, WEIGHTS
from squad.models.usage import ExpertUsage
from squad.posttrain.extract import extract
from tests.helpers import PY, ROOT, run_command, tiny_model, tool_env, write_run_config

HEADS = ["depth_euclidean", "normal", "class_scene"]
# every layer kind in one tiny model: MoE attention + MoE MLP, MoD (learned and attention routing), MoNE
EVERY_KIND = dict(plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "dense", "mod": "learned"},
                        {"attn": "dense", "mlp": "dense", "mod": "attention"}, {"mone": True}], depth=4)


def _model() -> squad.SquadViT:
    model = tiny_model(HEADS, **EVERY_KIND)
    usage = ExpertUsage(model.task_names)
    with torch.no_grad():
        usage.update(model(torch.rand(4, 3, 32, 32)).stats)
    model.usage = usage
    model.meta = {"extra": {"step": 7, "metrics": {"depth_euclidean": {"l1": 0.123}, "class_scene": {"top1": 0.5}}}}
    return model


def _images(b: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _preds(model, images):
    with torch.no_grad():
        out = model(images)
    return getattr(out, "preds", out)


def _hub_cache(cache: Path, repo: str, folder: Path, commit: str = "a" * 40) -> None:
    """``folder``'s files as huggingface_hub's cache holds a download of ``repo`` at ``commit`` (``main``)."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


# -------------------------------------------------------------------------------------------------- HF folders
def test_folder_round_trip_sharded_without_pickle(tmp_path, monkeypatch):
    model = _model()
    folder = squad.save_pretrained(model, tmp_path / "hf", max_shard_size=40_000)
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / WEIGHTS).exists()
    index = json.loads((folder / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == "squad.hf/1" and config["squad_version"] == squad.__version__
    assert config["tasks"] == HEADS and config["inference"]["mone_capacity"] == pytest.approx(model.mone_capacity)

    def no_pickle(*a, **k):
        raise AssertionError("loading a folder ran pickle")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    again = squad.load(folder)
    monkeypatch.undo()
    assert isinstance(again, squad.SquadViT) and not again.training
    images = _images()
    want, got = _preds(model, images), _preds(again, images)
    assert all(torch.equal(want[t], got[t]) for t in HEADS)
    assert again.meta["format"] == "squad.hf/1" and again.meta["extra"]["step"] == 7
    for table in ("counts", "tokens"):
        assert all(torch.equal(getattr(again.usage, table)[k], v) for k, v in getattr(model.usage, table).items())
    # written once more, unsharded: the old shards and index go
    squad.save_pretrained(again, folder)
    assert (folder / WEIGHTS).is_file() and not (folder / INDEX).exists() and not list(folder.glob("model-*"))


def test_model_card_reads_the_model_and_its_numbers(tmp_path):
    model = _model()
    card = (squad.save_pretrained(model, tmp_path / "hf") / "README.md").read_text()
    front = card.split("---")[1]
    for line in ("library_name: squad", "pipeline_tag: image-to-image", "- mixture-of-experts",
                 "- mixture-of-depths", "- mixture-of-nested-experts", "license: other"):
        assert line in front, line
    assert "| depth_euclidean | dense | 1 | l1 0.123 |" in card  # the validation metric in its task's row
    prof = squad.profile(model)
    assert f"{prof['params']:,} parameters" in card
    assert f"| class_scene | {prof['tasks']['class_scene']['active_params']:,} |" in card
    assert "| blocks.0.attn | MoE attention |" in card  # routing figures from the saved usage
    assert "trained 7 steps" in card and "TODO: state the licence" in card


def test_extracted_model_folder_keeps_its_experts(tmp_path):
    model = _model()
    ext = extract(model, "depth_euclidean", model.usage, theta=None, keep_top=0.5)
    save_extracted(tmp_path / "d.pt", ext)
    folder = squad.save_pretrained(squad.load(tmp_path / "d.pt"), tmp_path / "hf")
    again = squad.load(folder)
    assert isinstance(again, squad.SingleTaskModel) and again.task == "depth_euclidean"
    assert again.kept == ext.kept and again.exact == ext.exact
    images = _images()
    assert torch.equal(_preds(ext.eval(), images), _preds(again, images))
    card = (folder / "README.md").read_text()
    assert "pipeline_tag: depth-estimation" in card and "- extracted" in card
    with pytest.raises(ValueError, match="extracted single-task model"):
        squad.load_model(folder)


def test_folder_of_another_format_version_is_refused_naming_it(tmp_path):
    folder = squad.save_pretrained(tiny_model(HEADS), tmp_path / "hf", card=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "format": "squad.hf/2", "squad_version": "9.1.0"}))
    with pytest.raises(ValueError, match=r"squad 9\.1\.0 in format squad\.hf/2.*reads squad\.hf/1"):
        squad.load(folder)
    (folder / "config.json").write_text(json.dumps({**config, "format": "transformers"}))
    with pytest.raises(ValueError, match="not a squad model's"):
        squad.load(folder)


# ------------------------------------------------------------------------------------------------------ the hub
def test_hub_ids_resolve_from_the_cache_offline(tmp_path, monkeypatch, load_tool, capsys):
    model = tiny_model(HEADS)
    squad.save_pretrained(model, tmp_path / "hf")
    cache = tmp_path / "cache"
    _hub_cache(cache, "org/tiny", tmp_path / "hf", "b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    images = _images()
    for source in ("hf-hub:org/tiny", f"hf-hub:org/tiny@{'b' * 40}"):
        got = _preds(squad.load(source), images)
        assert all(torch.equal(got[t], _preds(model, images)[t]) for t in HEADS)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set and the cache"):
        squad.load("hf-hub:org/missing")
    with pytest.raises(ValueError, match="hf-hub:ORG/NAME"):
        squad.load("hf-hub:no-org")
    # a tool's --checkpoint takes the id (export: the model as model.pt; its outputs beside it, not in the cache)
    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", "hf-hub:org/tiny", "--format", "model.pt", "--out", str(tmp_path / "m.pt")]) == 0
    again = squad.load(tmp_path / "m.pt")
    assert all(torch.equal(_preds(again, images)[t], _preds(model, images)[t]) for t in HEADS)
    assert tool.main(["--checkpoint", "hf-hub:org/other", "--out", str(tmp_path / "x.pt2")]) == 2
    assert "holds no org/other" in capsys.readouterr().err


def test_train_init_takes_a_hub_id(tmp_path, monkeypatch):
    """``train.init: hf-hub:org/name`` starts a run from a folder in huggingface_hub's cache (its weights, as a
    squad model file would); an id the cache lacks is a ConfigError naming the key."""
    from squad.config import ConfigError
    from squad.io.weights import read_init_source
    from squad.train.run_folder import init_file

    model = tiny_model(HEADS)
    squad.save_pretrained(model, tmp_path / "hf", card=False)
    _hub_cache(tmp_path / "cache", "org/tiny", tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    class Cfg:  # the one key init_file reads
        class train:  # noqa: N801
            init = "hf-hub:org/tiny"

    local = init_file(Cfg, tmp_path / "run", None)
    assert Path(local).is_dir() and (Path(local) / "config.json").is_file()
    source = read_init_source(Cfg.train.init)
    images = _images()
    assert all(torch.equal(_preds(source, images)[t], _preds(model, images)[t]) for t in HEADS)
    Cfg.train.init = "hf-hub:org/missing"
    with pytest.raises(ConfigError, match="train.init: hf-hub:org/missing: HF_HUB_OFFLINE is set"):
        init_file(Cfg, tmp_path / "run", None)


def test_push_uploads_the_folder_with_the_library(tmp_path, monkeypatch, load_tool):
    import huggingface_hub

    squad.save_pretrained(tiny_model(HEADS), tmp_path / "src", card=False)
    squad.io.export_model(tmp_path / "model.pt", squad.load(tmp_path / "src"), None, {"step": 3})
    sent: dict = {}

    def create_repo(self, repo_id, **kw):
        sent["created"] = repo_id

    def upload_folder(self, *, repo_id, folder_path, **kw):
        sent.update(repo=repo_id, files=sorted(p.name for p in Path(folder_path).iterdir()),
                    config=json.loads((Path(folder_path) / "config.json").read_text()))
        return "https://huggingface.co/org/pushed/commit/1"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--format", "hf", "--out", str(tmp_path / "hf"),
                      "--push", "org/pushed"]) == 0
    assert sent["created"] == sent["repo"] == "org/pushed"
    assert sent["files"] == ["README.md", "config.json", "model.safetensors"]
    assert sent["config"]["extra"]["step"] == 3
    assert tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "y"),
                      "--push", "org/x"]) == 2  # --push with another format


# ------------------------------------------------------------------------------------------------------- ONNX
@pytest.mark.slow
def test_onnx_of_every_layer_kind_runs_in_onnx_runtime(tmp_path, tiny_data, load_tool, capsys):
    """One export covers dense, MoE attention, MoE MLP, MoD (learned and attention routing, top-k) and MoNE at a
    fixed capacity; ONNX Runtime's outputs on random and real images equal squad's within the export's 1e-4."""
    import onnxruntime as ort

    model = tiny_model(HEADS, **EVERY_KIND)
    squad.io.export_model(tmp_path / "model.pt", model, None)
    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--format", "onnx", "--mone-capacity", "0.5",
                      "--out", str(tmp_path / "m.onnx"), "--check-images", "2"]) == 0
    assert "check in ONNX Runtime on 2 random images" in capsys.readouterr().out
    model.set_mone_capacity(0.5)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == HEADS
    assert session.get_inputs()[0].name == "images"
    import onnx

    graph = onnx.load(str(tmp_path / "m.onnx"))
    custom = {f"{n.domain}:{n.op_type}" for n in graph.graph.node if n.domain not in ("", "ai.onnx")}
    assert not custom and not graph.functions, custom  # standard ONNX ops only: no squad or Triton op left
    real = _real_images(tiny_data)
    for images in (_images(1, 1), _images(5, 2), real):
        got = dict(zip(HEADS, session.run(None, {"images": images.numpy()}), strict=True))
        want = _preds(model, images)
        for t in HEADS:
            assert got[t].shape == tuple(want[t].shape)
            assert float((torch.from_numpy(got[t]) - want[t]).abs().max()) <= 1e-4, t


def _real_images(root: Path) -> torch.Tensor:
    """Four RGB images of the synthetic dataset, prepared as tools/predict.py prepares photos."""
    from squad.deploy.predict import load_image

    files = sorted(root.glob("rgb/*/*/*.png"))[:4]  # rgb/taskonomy/<building>/point_*_domain_rgb.png
    assert len(files) == 4
    return torch.stack([load_image(f, 32)[0] for f in files])


def test_onnx_refuses_what_it_cannot_express(tmp_path):
    from squad.deploy.onnx import export_onnx

    model = tiny_model(HEADS, plan=[{"attn": "dense", "mlp": "dense"},
                                    {"attn": "dense", "mlp": "dense", "mod": "learned"}], mod={"aux_loss": True})
    squad.models.inference.set_inference(model, mod_inference="threshold")
    with pytest.raises(ExportError, match=r"blocks\.1 \(a Mixture-of-Depths block\) runs threshold inference"):
        export_onnx(model, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


# --------------------------------------------------------------------------------- a trained run to every format
@pytest.mark.slow
def test_a_trained_run_goes_to_every_format_and_back(tmp_path, tiny_data, monkeypatch):
    """tools/train.py --hf-out on tiny data: the folder loads as the run's model.pt does, its card carries the
    run's validation metrics and command, and the same folder loads by hub id from a local cache."""
    config = write_run_config(tmp_path / "tiny.yaml", tiny_data, ["depth_euclidean", "class_scene"],
                              optim={"warmup_steps": 1, "steps": 2}, train={"ckpt_every": 2, "eval_every": 2})
    res = run_command([PY, "tools/train.py", "--config", str(config), "--out", str(tmp_path / "run"),
                       "--hf-out", "/dev/null/hf"], ROOT, tool_env(), 300)
    assert res.returncode == 2 and "--hf-out" in res.stderr and not (tmp_path / "run").exists()  # before training
    res = run_command([PY, "tools/train.py", "--config", str(config), "--out", str(tmp_path / "run"),
                       "--hf-out", str(tmp_path / "hf")], ROOT, tool_env(), 300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = squad.load(tmp_path / "run")
    folder = squad.load(tmp_path / "hf")
    images = _images(2)
    assert all(torch.equal(_preds(run, images)[t], _preds(folder, images)[t]) for t in run.task_names)
    card = (tmp_path / "hf" / "README.md").read_text()
    metrics = run.meta["extra"]["metrics"]
    task, values = next((t, v) for t, v in metrics.items() if isinstance(v, dict) and v)
    name, value = next(iter(sorted(values.items())))
    assert f"{value:.4g}" in card, (name, value)
    assert f"tools/train.py --config {config}" in card and "trained 2 steps" in card
    again = squad.save_pretrained(folder, tmp_path / "hf2") / "README.md"  # a folder's model keeps its run record
    assert f"tools/train.py --config {config}" in again.read_text()
    _hub_cache(tmp_path / "cache", "org/run", tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = squad.load("hf-hub:org/run")
    assert all(torch.equal(_preds(run, images)[t], _preds(hub, images)[t]) for t in run.task_names)
