"""Offline data tools (tools/make_data.py): nothing here runs while training.

- pack.py: a Taskonomy / PASCAL-Context / NYUD-v2 tree into HDF5 shards (`pack_shards`).
- stats/: a dataset's code and target statistics beside real Taskonomy's ranges (`dataset_stats`).
- random_tree.py: a Taskonomy tree of random files in the real encodings (tests, benchmarks).
"""
