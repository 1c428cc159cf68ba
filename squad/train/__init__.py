"""Training with DeepSpeed (the library side of tools/train.py).

- engine.py: the training loop (`train(cfg, run_dir)`, `Trainer`): data, DeepSpeed engine, logging, eval; the loop
  reads step → log → validate → checkpoint.
- checkpointer.py: the one owner of checkpoints: the tag layout, saving (cadence, end, signals), resolving and
  loading a resume, passing over a damaged tag, converting a tag written on another topology (universal checkpoint).
- signals.py: catching ``train.save_on_signal`` (SIGTERM, SIGUSR1, SIGHUP) from the tool's first line: exit 75 at
  once during start-up, then a request every rank agrees on at the next step.
- watchdog.py: `PeerWatch`, a thread per rank: a peer silent past ``train.peer_timeout`` or dead ends the run naming
  it, a signal that a rank stuck in a collective cannot handle still ends it, a rank whose deepspeed runner is gone
  stops as on a signal.
- stops.py: how a run stops early (`TrainingError`: exit 3, `Preempted`: exit 75, the ``STOPPED`` record), without
  torch.
- objective.py: `MultiTaskObjective` (fused forward, task losses, auxiliary losses, weighting).
- losses.py: mutual-information loss (all-reduced with autograd), switch/cv² balance, uncertainty weighting.
- cost.py: `measure_cost`, a bare forward + backward + AdamW step's time (wall, CPU) and peak memory.
- optim.py: AdamW parameter groups (no decay on norms/biases/embeddings) and the warm-up + cosine schedule.
- expert_shards.py: `ExpertShards`, the training side of expert parallelism: the shards' gradients (expert-data-
  parallel sums), their share of the clipping norm, their AdamW, their checkpoint files.
- expert_layout.py: a tag's experts moved between DeepSpeed's files and shard files when a layer's expert_parallel
  crosses 1 on resume (the checkpointer's `ExpertLayout` conversion).
- run_folder.py: the run folder's lock, the config and world-size checks on resume (before torch is imported),
  fresh starts over a run.
- shm.py: the /dev/shm segments DeepSpeed's CPU communication op leaves, freed.
Process-group helpers (`squad.distributed`) and CPU-rank tuning (`squad.runtime`) sit at the package top: data,
evaluation and analysis use them too.
"""
