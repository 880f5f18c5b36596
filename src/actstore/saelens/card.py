"""The dataset card (README.md) export-saelens writes beside the data, so that the folder
can be pushed to the Hugging Face Hub as it is (`HfApi().upload_folder(...,
repo_type="dataset")`): YAML metadata (tags, and a config that points the Hub's viewer and
`load_dataset` at the Arrow files), then what the data is and how it was made."""

from __future__ import annotations

import json
from typing import Any

from actstore._version import __version__
from actstore.read.api import Reader


def dataset_card(
    *,
    store: Reader,
    layer: int,
    hook: str,
    context_size: int,
    d_in: int,
    n_rows: int,
    n_tokens: int,
    dtype: str,
    seed: int,
    skip_special: bool,
    config: dict[str, Any],
) -> str:
    """README.md text for an export-saelens folder."""
    model = store.config.model_id or "unknown (the store records no model_id)"
    real_ids = bool(store.config.token_ids)
    ids = (
        "the model's vocabulary ids"
        if real_ids
        else "codes, since the store kept no vocabulary ids: -2 content token, -3 special token, -4 chat-template token"
    )
    cfg = json.dumps({k: v for k, v in config.items() if k != "cached_activations_path"}, indent=2)
    return f"""---
tags:
- sae-lens
- activations
- actstore
configs:
- config_name: default
  data_files:
  - split: train
    path: data-*.arrow
---
# Cached activations of `{hook}` ({model})

Activations of one hook of a language model, as the cached-activations dataset that
[SAELens](https://github.com/jbloomAus/SAELens) trains sparse autoencoders from
(`use_cached_activations=True`). Written by actstore {__version__} (`actstore export-saelens`).

| | |
|---|---|
| model | `{model}` |
| hook (column name, SAELens `hook_name`) | `{hook}` (actstore layer {layer}) |
| context size (tokens per row) | {context_size} |
| d_in | {d_in} |
| tokens | {n_tokens:,} |
| rows | {n_rows:,} |
| dtype | {dtype} |

## Schema

- `{hook}`: `Array2D(shape=({context_size}, {d_in}), dtype="{dtype}")`: one row of
  {context_size} token vectors.
- `token_ids`: `Sequence(Value("int32"), length={context_size})`: {ids}; -1 fills the end of the
  last rows (no token: exclude it with `exclude_special_tokens=[-1]`).

## How it was made

Captured into an actstore store (`{store.path}`), then exported: every real token of
layer {layer} ({"special and chat-template tokens left out" if skip_special else "padding left out"}),
shuffled at token level with seed {seed} (SAELens reads rows in order and mixes only a few
rows at a time), packed {context_size} to a row. The row count is a multiple of
`store_batch_size_prompts`, so SAELens reads every row.

## Use

SAELens settings (`LanguageModelSAERunnerConfig`; `cached_activations_path` is this folder):

```json
{cfg}
```

Push this folder as it is, and load it back:

```python
from huggingface_hub import HfApi, snapshot_download
import datasets

HfApi().upload_folder(folder_path="THIS_FOLDER", repo_id="USER/NAME", repo_type="dataset")
folder = snapshot_download("USER/NAME", repo_type="dataset")
ds = datasets.load_from_disk(folder)  # or SAELens: cached_activations_path=folder
```

Back into an actstore store: `actstore import-saelens THIS_FOLDER STORE`.
"""
