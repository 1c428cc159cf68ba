"""Evaluation: metrics of models on a split, reports, and Δt against a baseline.

* `squad.eval.metrics`: `MetricAccumulator` (metric sums over batches and ranks), `all_reduce_sums`, `delta_t` (Δt).
* `squad.eval.evaluate`: `evaluate`, `eval_loader`, `evaluate_file`, `side_by_side`, `delta_against`, `format_results`.
* `squad.eval.edges`: odsF of edge maps with the SEISM conventions (thinning, one-to-one matching within maxDist).
"""

from squad.eval.evaluate import evaluate, evaluate_file, format_results
from squad.eval.metrics import MetricAccumulator, delta_t

__all__ = ["MetricAccumulator", "delta_t", "evaluate", "evaluate_file", "format_results"]
