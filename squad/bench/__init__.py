"""The performance table of tools/bench.py: ratios timed side by side in one process.

- harness.py: `BenchResult`, interleaved timing, ratio rows and target checks.
- cases.py: the case registry (`CASES`) and the model cases (MoE MLP, MoA, fused step, MoD, MoNE, profile table).
- extract.py: the extracted-model case (parameters and forward time against the full model).
- data.py: HDF5 shards against the PNG tree.
The routed-attention kernel's own benchmark lives beside the kernel (squad.kernels.bench).
"""
