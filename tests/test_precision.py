"""--precision bf16|fp32 on evaluate, predict, extract and export (squad.models.precision), and the bf16 forward
of predict/evaluate without host syncs on the CUDA path (counted by the traffic recorder)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import squad
from squad.bench.traffic import TrafficRecorder
from squad.deploy.predict import run_model
from squad.eval.evaluate import evaluate, model_dataset
from squad.io import export_model
from squad.models.precision import cast_copy, cast_model, precision_dtype
from tests.helpers import tiny_model

HEADS = ["depth_euclidean", "normal", "class_scene"]
MODSQUAD = [{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "learned"}]


def test_defaults_names_and_copies():
    assert precision_dtype(None, "cuda") == torch.bfloat16 and precision_dtype(None, "cuda:1") == torch.bfloat16
    assert precision_dtype(None, "cpu") == torch.float32 and precision_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="bf16, fp32.*'fp16'"):
        precision_dtype("fp16", "cpu")
    model = tiny_model(HEADS, plan=MODSQUAD)
    copy = cast_copy(model, torch.bfloat16)
    assert next(copy.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    assert cast_copy(model, torch.float32) is model


def test_bf16_forward_of_predict_and_evaluate_never_waits_for_the_device(tiny_data):
    """The CUDA path (forced) of what predict and evaluate run, in bf16: the model's forward has no host sync; the
    syncs of a whole evaluation (its metrics) do not grow with the depth."""
    syncs = {}
    for depth in (2, 4):
        model = tiny_model(HEADS, plan=MODSQUAD, depth=depth).eval()
        dtype = cast_model(model, "bf16", "cpu")
        with torch.no_grad(), TrafficRecorder() as rec:
            run_model(model, torch.rand(2, 3, 32, 32), HEADS)
        assert rec.summary().syncs == 0
        ds = model_dataset(model, tiny_data, ["depth_euclidean"], "val")
        loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=squad.data.collate)
        with TrafficRecorder() as rec:
            evaluate(model, loader, ["depth_euclidean"], "cpu", max_batches=1, dtype=dtype)
        syncs[depth] = [r.op for r in rec.summary().records if r.sync]
    assert syncs[2] == syncs[4], syncs


def test_the_tools_take_precision(tiny_data, tmp_path, load_tool):
    model_pt = export_model(tmp_path / "model.pt", tiny_model(HEADS, plan=MODSQUAD), usage=None)
    out = tmp_path / "eval.json"
    assert load_tool("tools/evaluate.py").main(["--checkpoint", str(model_pt), "--data", str(tiny_data),
                                                "--batches", "1", "--precision", "bf16", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["precision"] == "bf16"

    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(images / "a.png")
    assert load_tool("tools/predict.py").main(["--checkpoint", str(model_pt), "--images", str(images), "--out",
                                               str(tmp_path / "pred"), "--precision", "bf16", "--quiet"]) == 0
    assert json.loads((tmp_path / "pred" / "predictions.json").read_text())["precision"] == "bf16"

    ext = tmp_path / "depth.pt"
    assert load_tool("tools/extract.py").main(["--checkpoint", str(model_pt), "--task", "depth", "--data",
                                               str(tiny_data), "--calib-batches", "1", "--eval-batches", "1",
                                               "--keep-top", "0.5", "--precision", "bf16", "--out", str(ext)]) == 0
    assert json.loads(ext.with_suffix(".json").read_text())["precision"] == "bf16"
    assert next(squad.load(ext).parameters()).dtype == torch.float32  # pruned and saved as loaded

    export = load_tool("tools/export.py")
    assert export.main(["--checkpoint", str(ext), "--out", str(tmp_path / "d.pt2"), "--precision", "bf16"]) == 0
    extra = {"squad.json": ""}
    torch.export.load(tmp_path / "d.pt2", extra_files=extra)
    assert json.loads(extra["squad.json"])["dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match="2"):  # an unknown precision is a usage error
        export.main(["--checkpoint", "x", "--out", "y", "--precision", "fp16"])
    code = export.main(["--checkpoint", str(model_pt), "--format", "model.pt", "--precision", "bf16",
                        "--out", str(tmp_path / "m.pt")])
    assert code == 2  # --precision applies to the program only
