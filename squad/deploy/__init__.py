"""Using a trained model outside training: running it on image files and exporting it.

- predict.py: `predict` — any squad model on JPEG/PNG files, batched; per task a readable picture and raw values.
- pictures.py: colour maps, normals as RGB, segment palettes: the pictures `predict` writes.
- encode.py: `encode_taskonomy` — predictions back into Taskonomy's own file encodings (``--encode taskonomy``).
- export.py: `export_program` — a `torch.export` program that runs without squad installed.
- onnx.py: `export_onnx` — the same graph as an ONNX file (torch's dynamo exporter), `check_onnx` in ONNX Runtime.
- hf.py: `save_pretrained` — a Hugging Face-style folder (safetensors, config.json, a generated model card),
  `push_to_hub` — the folder uploaded with huggingface_hub.
"""
