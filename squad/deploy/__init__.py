"""Using a trained model outside training: running it on image files and exporting it.

- predict.py: `predict` — any squad model on JPEG/PNG files, batched; per task a readable picture and raw values.
- pictures.py: colour maps, normals as RGB, segment palettes: the pictures `predict` writes.
- encode.py: `encode_taskonomy` — predictions back into Taskonomy's own file encodings (``--encode taskonomy``).
- export.py: `export_program` — a `torch.export` program that runs without squad installed.
"""
