"""Reproducing the papers' claims on the embedded data (tools/reproduce.py).

One experiment per claim; each run is an ordinary run folder; a report (markdown, figures, results.json).
"""
