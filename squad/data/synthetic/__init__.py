"""Synthetic datasets, rendered on the CPU and written in the real datasets' own layouts and encodings (the embedded
default every test, the demo and the reproduction train on; tools/make_data.py synthetic).

- render.py: the analytic ray caster (rooms, boxes, spheres, cylinders, openings, a lamp at the camera).
- annotate.py: Taskonomy's 2-D annotators (edges, keypoints, segments) re-implemented.
- taskonomy.py: the synthetic Taskonomy, all 13 domains (`render_dataset`).
- dense.py: scenes shared by the PASCAL-Context and NYUD-v2 generators (labelled objects, people of parts).
- pascal.py: the synthetic PASCAL-Context in the PASCAL_MT layout (`render_pascal`).
- nyud.py: the synthetic NYUD-v2 in the MTI-Net layout (`render_nyud`).
"""
