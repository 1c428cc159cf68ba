"""The performance table of tools/bench.py: ratios timed side by side in one process.

- harness.py: `BenchResult`, interleaved timing, ratio rows and target checks.
- cases.py: the case registry (`CASES`) and the model cases (MoE MLP, MoA, fused step, MoD, MoNE, profile table).
- step.py: the training-step case (`train_step`: images/s, MFU, peak memory; eager/compiled, checkpointing).
- plan.py: the capacity plan of a training run (``tools/bench.py --plan CONFIG --gpus N``), an estimate from a step
  measured here.
- layouts.py: memory per GPU, the 80 GiB GPUs needed, gradient/weight and all-to-all bytes per step of every ZeRO stage
  and expert-parallel size (the plan's layout table).
- memory.py: peak memory on any device (CUDA's statistics, or every tensor storage followed on the CPU).
- extract.py: the extracted-model case (parameters and forward time against the full model).
- data.py: HDF5 shards against the PNG tree.
- engine.py: the training engine's step and whole run against bare steps (CPU time, the reproduction's widths).
- traffic.py: `TrafficRecorder`: every launched op's kernels, FLOPs, bytes, host syncs, atomics, counted on any device.
- cuda_path.py: what makes a CPU or meta recording follow CUDA's path (forced algorithm, fused SDPA, Triton launches).
- flops.py: attention FLOP counts, shared by the recorder and its CUDA path (below both: no import circle).
- traffic_profile.py: the ``traffic`` case: the routed layers against their dense twins, counted and priced;
  twins.py: the dense twins recorded with cuBLASLt's fused epilogues.
- costmodel.py: the H100 cost models that price a recording: the kernel model (each kernel at the rate of what runs
  it, tile re-reads through L2, waves, CUDA-core work; low / central / high from its constants' ranges) and the model
  fitted to measured runs.
- calibrate.py: the model's calibration on 84de653's code (``tools/bench.py --fit-traffic``); legacy.py: the script
  that records that commit's cases in its own process.
- gpucheck.py: ``make gpu-check``: the GPU tests, GPU rows beside the model, train steps, a DeepSpeed run.
The routed-attention kernel's own benchmark lives beside the kernel (squad.kernels.bench).
"""
