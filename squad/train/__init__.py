"""Training with DeepSpeed (the library side of tools/train.py).

- engine.py: the training loop (`train(cfg, run_dir)`, `Trainer`): data, DeepSpeed engine, logging, eval, resume.
- objective.py: `MultiTaskObjective` (fused forward, task losses, auxiliary losses, weighting) and `TrainingError`.
- losses.py: mutual-information loss (all-reduced with autograd), switch/cv² balance, uncertainty weighting.
- cost.py: `measure_cost`, a bare forward + backward + AdamW step's time (wall, CPU) and peak memory.
- optim.py: AdamW parameter groups (no decay on norms/biases/embeddings) and the warm-up + cosine schedule.
- checkpoint.py: checkpoint tags, the COMPLETE marker and ``latest``, finding the tag to resume.
- run_folder.py: the run folder's lock, the config and world-size checks on resume, fresh starts over a run,
  and the /dev/shm segments DeepSpeed's CPU comm op leaves.
Process-group helpers (`squad.distributed`) and CPU-rank tuning (`squad.runtime`) sit at the package top: data,
evaluation and analysis use them too.
"""
