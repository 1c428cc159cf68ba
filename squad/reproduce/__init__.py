"""Reproducing the papers' claims on the embedded data (tools/reproduce.py).

One experiment per claim; each run is an ordinary run folder; a report (markdown, figures, results.json).

* `scales`: tiny / small / cpu / gpu / paper — widths, images, step budgets, seeds, the time plan;
* `runs`: a run's config from a method family's paper config, training it in-process with squad's engine (skipped
  when done; refused when done with other settings; long runs checkpoint and resume);
* `specs`: the runs each claim needs (`Context`, `cached` post-training results);
* `parallel`: ``--parallel N``: N runs (or post-training jobs) at once, each in a process of its own;
* `stats` and `verdicts`: paired per-seed differences, a one-sided t-test per comparison on its own differences,
  Holm over a claim's parts (and over its secondary ones), the verdict rule (reproduced only when every part holds),
  a null simulation on the report's own shapes, Δt;
* `tolerance`: the cross-machine tolerance — a sample of runs trained again with another thread count;
* `rejudge`: an interim re-judgement of a committed results.json under the current rule;
* `rerun`: ``--rerun RUN --against results.json``: one run of a report trained again here and checked against the
  report's stated per-run tolerance;
* `gate`: the learnability gate — Δt counts a task only when its reference model beats the best image-independent
  predictor (`squad.eval.prior`, fitted on the validation images) by ≥ 5 % on every seed and beyond the seed noise;
* `measure`: baselines, Δt curves over training steps with 95 % intervals, the plateau of a validation curve;
* `claims` (the registry), `claims_modsquad` (modsquad-table2, pruning, mi-vs-balance), `claims_curve`
  (table2-curve), `claims_transfer` (router-finetune, pascal-table3), `claims_budget` (amod-table3, mone-budget);
* `finetune`: router-finetune's fine-tunes, every mode with the same budget, lr choice and stopping rule;
* `report` and `figures`: report.md, figures/*.png, results.json;
* `summary`: the verdicts block README.md and docs/reproduce.md quote (``python tools/docs.py verdicts``);
* `paper`: ``--scale paper``'s run configs and ``deepspeed --hostfile`` commands (written, not run).
"""
