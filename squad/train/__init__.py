"""Training with DeepSpeed (the library side of tools/train.py).

- engine.py: the training loop (`train(cfg, run_dir)`, `Trainer`): data, DeepSpeed engine, logging, eval, resume.
- objective.py: `MultiTaskObjective` (fused forward, task losses, auxiliary losses, weighting) and `TrainingError`.
- losses.py: mutual-information loss (all-reduced with autograd), switch/cv² balance, uncertainty weighting.
- optim.py: AdamW parameter groups (no decay on norms/biases/embeddings) and the warm-up + cosine schedule.
- checkpoint.py: checkpoint tags, the COMPLETE marker and ``latest``, finding the tag to resume.
- expert_shards.py: `ExpertShards`, the training side of expert parallelism: the shards' gradients (expert-data-
  parallel sums), their share of the clipping norm, their AdamW, their checkpoint files.
- expert_layout.py: a tag's experts moved between DeepSpeed's files and shard files when a layer's expert_parallel
  crosses 1 on resume.
- run_folder.py: the run folder's lock, the config and world-size checks on resume, fresh starts over a run,
  and the /dev/shm segments DeepSpeed's CPU comm op leaves.
Process-group helpers (`squad.distributed`) and CPU-rank tuning (`squad.runtime`) sit at the package top: data,
evaluation and analysis use them too.
"""
