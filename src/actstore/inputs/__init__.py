"""Inputs: what a model is run over, and the model itself, before any capture.

Data sources (an image folder, JSONL, a saved `datasets` folder, text files, embedded
data), text decoding, records turned into model inputs (images resized, texts tokenised
with token-kind labels), corpus packing into context windows (`token_origins`), and
models loaded from a folder, a hub id in the local cache or an embedded default. Capture
runs these; the feature views use them too (tokenizers, token origins, images), without
importing capture. Importing this package does not import torch.
"""
