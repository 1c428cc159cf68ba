"""Looking inside a model: what it routes where, and what it costs.

- relations.py: task-relation matrices from per-token expert selections (`task_relations`).
- figures.py: heatmaps and relation plots, and the tools/visualize.py pipeline (`draw_figures`).
- flops.py: `profile` — parameters, active parameters per token and MACs per image per task.

The statistics they read are `squad.models.usage.ExpertUsage`.
"""
