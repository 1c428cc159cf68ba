"""Reproducing the papers' claims on the embedded data (tools/reproduce.py).

One experiment per claim; each run is an ordinary run folder; a report (markdown, figures, results.json).

* `scales`: tiny / small / gpu / paper — widths, images, step budgets, seeds, the time plan;
* `runs`: a run's config from a method family's paper config, training it in-process with squad's engine (skipped
  when done; refused when done with other settings), the cost measurement (step time, peak memory);
* `parallel`: ``--parallel N``: N runs (or post-training jobs) at once, each in a process of its own;
* `verdicts`: paired per-seed comparisons, preconditions, the verdict rule, Δt;
* `claims`: one function per claim (modsquad-table2, pruning, router-finetune, mi-vs-balance, amod-table3,
  mone-budget, pascal-table3 — the last on its own synthetic PASCAL-Context data);
* `finetune`: router-finetune's fine-tunes, every mode with the same budget, lr choice and stopping rule;
* `report`: report.md, figures/*.png, results.json;
* `paper`: ``--scale paper``'s run configs and ``deepspeed --hostfile`` commands (written, not run).
"""
