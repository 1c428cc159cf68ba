"""Task options travel with the model that owns them: two models with different ``model.task_options`` in one
process each decode their targets and score their predictions by their own options (no process-wide registry)."""

from __future__ import annotations

import dataclasses

import torch

import squad
from squad.config.loading import load_config
from squad.data import eval_loader
from squad.eval.evaluate import evaluate, evaluate_model, model_dataset
from squad.eval.metrics import MetricAccumulator
from squad.io import export_model
from squad.tasks import get_task
from squad.train.objective import MultiTaskObjective
from tests.helpers import tiny_model

TASK = "edge_occlusion"
CLIP = {TASK: {"decode": "clip"}}


def _manual_metrics(model, data, options) -> dict[str, float]:
    """The metrics of ``model`` computed by hand with the task built from ``options`` (decode and score)."""
    task = get_task(TASK, options)
    ds = squad.data.build_dataset(data, [TASK], "val", image_size=model.cfg.img_size, augment=False,
                                  task_options=options)
    acc = MetricAccumulator([task])
    with torch.no_grad():
        for batch in eval_loader(ds, 4):
            pred = model(batch["rgb"], [TASK]).preds[TASK]
            acc.update(TASK, task.metric_sums(pred.float(), task.target(batch["targets"][TASK]), batch["masks"][TASK]))
    return acc.compute()[TASK]


def test_two_models_with_different_edge_decodes_each_use_their_own(tiny_data, tmp_path):
    blur_model = tiny_model([TASK, "depth"])
    clip_model = tiny_model([TASK, "depth"])
    clip_model.cfg = dataclasses.replace(clip_model.cfg, task_options=CLIP)
    export_model(tmp_path / "blur.pt", blur_model, None)
    export_model(tmp_path / "clip.pt", clip_model, None)
    blur, clip = squad.load(tmp_path / "blur.pt"), squad.load(tmp_path / "clip.pt")  # both live in this process

    assert blur.get_task(TASK).frame_filter and blur.get_task(TASK).spec.clip is None
    assert not clip.get_task(TASK).frame_filter and clip.get_task(TASK).spec.clip == (0.0, 0.00625)
    assert get_task(TASK).frame_filter  # the default is untouched by loading either

    # decoding: each model's data holds its own targets (blurred units vs plain units)
    blur_ds, clip_ds = model_dataset(blur, tiny_data, [TASK], "val"), model_dataset(clip, tiny_data, [TASK], "val")
    tb, tc = blur_ds[0]["targets"][TASK], clip_ds[0]["targets"][TASK]
    assert not torch.equal(tb, tc)
    plain = squad.data.build_dataset(tiny_data, [TASK], "val", image_size=32, augment=False, task_options=CLIP)
    assert torch.equal(tc, plain[0]["targets"][TASK])

    # scoring: the same weights give each model the metrics of its own options, in either order
    first_blur = evaluate_model(blur, [TASK], tiny_data, "val", batch_size=4)[TASK]
    clip_metrics = evaluate_model(clip, [TASK], tiny_data, "val", batch_size=4)[TASK]
    again_blur = evaluate_model(blur, [TASK], tiny_data, "val", batch_size=4)[TASK]
    assert first_blur == again_blur
    assert first_blur != clip_metrics
    assert first_blur == _manual_metrics(blur, tiny_data, None)
    assert clip_metrics == _manual_metrics(clip, tiny_data, CLIP)


def test_training_objective_and_evaluate_use_the_models_options(tiny_data):
    model = tiny_model([TASK])
    model.cfg = dataclasses.replace(model.cfg, task_options=CLIP)
    objective = MultiTaskObjective(model, [TASK], load_config("configs/demo.yaml"))
    assert objective._specs[TASK] is model.get_task(TASK) and not objective._specs[TASK].frame_filter
    ds = model_dataset(model, tiny_data, [TASK], "val")
    assert evaluate(model, eval_loader(ds, 4), [TASK])[TASK] == _manual_metrics(model, tiny_data, CLIP)
