"""Evaluation: metrics of models on a split, reports, and Δt against a baseline.

* `squad.eval.metrics`: `MetricAccumulator` (each task's additive metric statistics summed over batches and
  ranks, then finalised), `all_reduce_sums`, and `delta_t` (Mod-Squad's Δt, each metric with its task's direction).
* `squad.eval.evaluate`: `evaluate` (a model over a loader), `eval_loader`, `evaluate_file` / `side_by_side` (saved
  models on a split), `load_baseline` / `delta_against` (Δt against results files) and `format_results` (tables).
"""

from squad.eval.evaluate import evaluate, evaluate_file, format_results
from squad.eval.metrics import MetricAccumulator, delta_t

__all__ = ["MetricAccumulator", "delta_t", "evaluate", "evaluate_file", "format_results"]
