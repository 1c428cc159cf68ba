"""Statistics of a Taskonomy dataset beside the real files' (``python tools/make_data.py stats ROOT``).

`dataset_stats(root)` samples up to `max_images` views of a Taskonomy tree (either layout, split CSVs as the reader
takes them), of the synthetic tree (the same format) or of HDF5 shards written by ``make_data.py pack``, and gives
per domain: code statistics (on the raw codes, read with `squad.data.taskonomy.read_raw`), target-space statistics
(through the project's own decoders: ``get_task(d).decode`` then ``.target``), the masked share, ids per image for
the segment domains and the spread of the class distributions, each beside the range real Taskonomy files show and
flagged when it falls outside. It is how a user checks a download, and how the synthetic renderer is held to
Taskonomy (``tests/test_data_stats.py``).

Pixels: valid pixels are the depth_zbuffer geometry mask (code ≠ 65535), ANDed with the task's own decode mask, for
the geometric tasks (`Task.geometric`); every pixel counts for the others. The "masked" statistics look at the
geometry-invalid pixels (the fill codes). Views lacking depth_zbuffer use the task's own mask.

Sampling: views are taken evenly across buildings (sorted), deterministically: with more buildings than
`max_images`, one view (the middle one of the sorted names) from each of `max_images` evenly spaced buildings;
otherwise the budget is shared out evenly over buildings (water filling) and each building's views are taken evenly
spaced in sorted order. Accumulators stream (codes go into integer histograms — exact quantiles, means and shares —
target values into per-channel moments), so memory does not grow with the number of pixels.

Reference ranges (`REFERENCES`) are the real files' figures collected in the project's FACTS (§5, "What real files
look like"): real-format example views shipped in the omnidata repository (a Taskonomy building, Replica, HM3D) and
the per-task constants of tstandley/taskgrouping, measured on real Taskonomy. They are never fitted to synthetic
data. Tolerance rule (one rule for every row): since single views are indicative only, a value is accepted within
the stated range widened on each side by `TOLERANCE` (25 %) of the larger magnitude of its bounds, and at least by
the row's ``floor`` (non-zero only for ranges around 0, where a relative margin is empty). An approximate figure
("~2.9 m") is the range [2.9, 2.9] under the same rule.

Modules: references.py (the ranges and the tolerance rule), accumulators.py (streaming statistics per domain),
sources.py (trees and shards, sampling), report.py (flags, table, JSON; `dataset_stats`).
"""

from squad.data.offline.stats.accumulators import CodeHistogram, Moments
from squad.data.offline.stats.references import REFERENCES, SOURCES, TOLERANCE, VALID, Reference
from squad.data.offline.stats.report import DatasetStats, DomainStats, Stat, dataset_stats
from squad.data.offline.stats.sources import sample_views

__all__ = ["REFERENCES", "SOURCES", "TOLERANCE", "VALID", "CodeHistogram", "DatasetStats", "DomainStats", "Moments",
           "Reference", "Stat", "dataset_stats", "sample_views"]
