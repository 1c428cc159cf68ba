"""Evaluation: metrics of models on a split, reports, and Δt against a baseline.

* `squad.eval.metrics`: `MetricAccumulator` (metric sums over batches and ranks), `all_reduce_sums`, `delta_t` (Δt).
* `squad.eval.evaluate`: `evaluate` (a model over a loader), `evaluate_model` / `evaluate_run` (a loaded model on a
  split, with its compute), `side_by_side`, `delta_against`, `format_results`.
* `squad.eval.prior`: `image_independent` — what a predictor that never looks at the image scores (the training
  split's per-pixel mean or median map, global constants, class frequencies), with the tasks' own metrics.

Edge scoring (odsF, SEISM conventions) is the edge task's own: `squad.tasks.edges`.
"""

from squad.eval.evaluate import evaluate, evaluate_model, evaluate_run, format_results
from squad.eval.metrics import MetricAccumulator, delta_t

__all__ = ["MetricAccumulator", "delta_t", "evaluate", "evaluate_model", "evaluate_run", "format_results"]
