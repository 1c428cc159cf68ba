"""`squad.io.load`: one loader for a run folder, a ``model.pt``, an extracted file and a DeepSpeed checkpoint tag;
weights_only everywhere (a pickle that would run code is refused, and does not run), shape errors that name the
tensor, ``str`` paths, and the usage/metadata attributes of what it returns."""

import shutil
import sys

import pytest
import torch
import yaml

from squad.io import (
    CHECKPOINT_FORMAT,
    EXTRACTED_FORMAT,
    MODEL_FORMAT,
    export_model,
    load,
    load_extracted,
    load_model,
    save_extracted,
)
from squad.io.checkpoints import COMPLETE, MODEL_STATES
from squad.models.single_task import SingleTaskModel
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT
from squad.posttrain.extract import collect_usage, extract
from tests.helpers import ROOT, run_command, tiny_model, tool_env

HEADS = ["depth_euclidean", "normal"]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data):
    """A real run of tools/train.py (one process, 2 steps, a checkpoint after each): model.pt and two tags."""
    cfg = {
        "model": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                  "plan": [{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "dense", "mod": "learned"}],
                  "moa": {"num_experts": 4, "top_k": 2, "head_dim": 16, "router": {"noise": False}},
                  "moe": {"num_experts": 4, "top_k": 2}, "mod": {"capacity": 0.5}, "heads": HEADS},
        "loss": {"weighting": "uncertainty"},
        "data": {"root": str(tiny_data), "workers": 0, "augment": False, "val_batches": 1},
        "optim": {"lr": 5e-3, "steps": 2, "batch_per_rank": 4},
        "train": {"seed": 0, "log_every": 1, "ckpt_every": 1, "progress": False},
    }
    folder = tmp_path_factory.mktemp("io_run")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    out = folder / "run"
    res = run_command([sys.executable, "tools/train.py", "--config", str(folder / "tiny.yaml"), "--out", str(out)],
                      ROOT, tool_env(), 600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_run_folder_and_model_file(run):
    model = load(run)
    assert isinstance(model, SquadViT) and not model.training
    assert model.meta["format"] == MODEL_FORMAT and model.meta["path"] == str(run / "model.pt")
    assert model.meta["tasks"] == HEADS and model.meta["extra"]["step"] == 2
    assert "state_dict" not in model.meta and "usage" not in model.meta
    assert isinstance(model.usage, ExpertUsage) and model.usage.counts
    same = load(str(run / "model.pt"))  # str paths too
    assert _same_weights(model, same)
    assert load_model(str(run)).meta["path"] == model.meta["path"]


def test_checkpoint_tags(run):
    final = load(run)
    latest = load(run / "checkpoints")  # the run's checkpoints/ folder: its latest complete tag
    assert isinstance(latest, SquadViT) and not latest.training
    assert latest.meta["format"] == CHECKPOINT_FORMAT
    assert latest.meta["path"] == str(run / "checkpoints" / "step00000002")
    assert latest.meta["extra"]["step"] == 2 and latest.meta["extra"]["trained_tasks"] == HEADS
    assert _same_weights(latest, final)  # the last checkpoint holds the exported weights
    assert torch.equal(latest.usage.tokens[next(iter(latest.usage.tokens))],
                       final.usage.tokens[next(iter(final.usage.tokens))])
    first = load(str(run / "checkpoints" / "step00000001"))
    assert first.meta["extra"]["step"] == 1 and not _same_weights(first, final)
    by_file = load(run / "checkpoints" / "step00000001" / MODEL_STATES)
    assert _same_weights(by_file, first)
    assert _same_weights(load_model(run / "checkpoints"), final)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert set(latest(x).preds) == set(HEADS)


def test_incomplete_or_orphaned_checkpoints_are_refused(run, tmp_path):
    copy = tmp_path / "run"
    (copy / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step00000001", copy / "checkpoints" / "step00000001")
    (copy / "checkpoints" / "step00000001" / COMPLETE).unlink()  # a save killed before every rank finished
    (copy / "checkpoints" / "latest").write_text("step00000001")
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        load(copy / "checkpoints" / "step00000001")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load(copy / "checkpoints")
    with pytest.raises(FileNotFoundError, match="holds no model.pt.*checkpoints"):
        load(copy)
    (copy / "checkpoints" / "step00000001" / COMPLETE).write_text('{"step": 1}')
    assert load(copy / "checkpoints").meta["extra"]["tag"] == "step00000001"  # the tag's own config.yaml
    (copy / "checkpoints" / "step00000001" / "config.yaml").unlink()  # a tag of an earlier version: the run's
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        load(copy / "checkpoints")
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    assert load(copy / "checkpoints").meta["extra"]["tag"] == "step00000001"


def test_checkpoint_with_deepspeed_records_loads_with_an_explicit_allow_list(run, tmp_path):
    """fp16 loss scalers and bf16 fragment addresses are DeepSpeed objects weights_only refuses by default; exactly
    those are allowed, and half-precision module weights come back as the model's fp32."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    tag = tmp_path / "run" / "checkpoints" / "step00000002"
    shutil.copytree(run / "checkpoints" / "step00000002", tag)
    shutil.copy(run / "config.yaml", tmp_path / "run" / "config.yaml")
    states = torch.load(tag / MODEL_STATES, weights_only=True)
    states["module"] = {k: v.to(torch.bfloat16) for k, v in states["module"].items()}
    states["optimizer"] = {"loss_scaler": DynamicLossScaler(2.0**16, 1000, 1, 2, False),
                           "param_slice_mappings": [{"model.pos_embed": fragment_address(numel=4, start=0)}]}
    torch.save(states, tag / MODEL_STATES)
    model = load(tag)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    reference = load(run)
    for key, value in reference.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16).float()), key


class _WritesAFile:
    """Unpickling this calls ``open(target, "w")``: a stand-in for any code a pickle can run."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


def test_pickle_payloads_are_refused_without_running(run, tmp_path):
    target = tmp_path / "pwned"
    bad = tmp_path / "model.pt"
    torch.save({"format": MODEL_FORMAT, "config": {}, "state_dict": {}, "hook": _WritesAFile(target)}, bad)
    with pytest.raises(ValueError, match="not a loadable squad model file"):
        load(bad)
    with pytest.raises(ValueError, match="not a loadable squad model file"):
        load_extracted(str(bad))
    tag = tmp_path / "run" / "checkpoints" / "step00000002"
    shutil.copytree(run / "checkpoints" / "step00000002", tag)
    shutil.copy(run / "config.yaml", tmp_path / "run" / "config.yaml")
    states = torch.load(tag / MODEL_STATES, weights_only=True)
    states["client"] = _WritesAFile(target)
    torch.save(states, tag / MODEL_STATES)
    with pytest.raises(ValueError, match="weights_only loading refuses this checkpoint"):
        load(tag)
    assert not target.exists()


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    path = export_model(str(tmp_path / "model.pt"), tiny_model(HEADS), None)
    payload = torch.load(path, weights_only=True)
    want = tuple(payload["state_dict"]["pos_embed"].shape)
    payload["state_dict"]["pos_embed"] = torch.zeros(1, 5, 32)
    torch.save(payload, path)
    with pytest.raises(ValueError) as err:
        load(path)
    message = str(err.value)
    assert str(path) in message and "pos_embed" in message
    assert "has shape (1, 5, 32)" in message and f"the config needs {want}" in message


def test_saved_usage_and_metadata(tmp_path):
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", [torch.randn(2, 3, 32, 32)])
    path = export_model(str(tmp_path / "sub" / "model.pt"), model, usage, {"step": 7})  # creates sub/
    loaded = load(path)
    assert loaded.usage.state_dict().keys() == usage.state_dict().keys()
    for layer, tokens in usage.tokens.items():
        assert torch.equal(loaded.usage.tokens[layer], tokens)
    assert loaded.meta["extra"] == {"step": 7} and _same_weights(loaded, model)
    assert load(export_model(tmp_path / "bare.pt", model, None)).usage is None
    assert [p.name for p in tmp_path.rglob(".*tmp*")] == []  # atomic writes leave no temporary files


def test_extracted_file(tmp_path):
    model = tiny_model(HEADS)
    ext = extract(model, "normal", collect_usage(model, "normal", [torch.randn(2, 3, 32, 32)]), theta=0.05)
    path = save_extracted(str(tmp_path / "normal.pt"), ext, {"theta": 0.05})
    loaded = load(str(path))
    assert isinstance(loaded, SingleTaskModel) and loaded.usage is None
    assert loaded.meta["format"] == EXTRACTED_FORMAT and loaded.meta["task"] == "normal"
    assert loaded.meta["report"] == {"theta": 0.05} and loaded.kept == ext.kept
    assert _same_weights(loaded, load_extracted(path))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), ext(x))
    with pytest.raises(ValueError, match="is an extracted single-task model"):
        load_model(path)
    full = export_model(tmp_path / "model.pt", model, None)
    with pytest.raises(ValueError, match="full multi-task model file"):
        load_extracted(full)


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="model file not found"):
        load(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="holds no model.pt"):
        load(str(tmp_path))
