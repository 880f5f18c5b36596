"""export-saelens's dataset card: the README.md that lets the folder be pushed to the Hub as
it is. The folder is tested (no network): the card's metadata parses with huggingface_hub,
its data_files config loads the rows the way the Hub's `load_dataset` does, and the card
states the model, hook, context size, token count and schema."""

from __future__ import annotations

import numpy as np
import pytest

import actstore
from actstore.saelens import export_saelens

pytestmark = pytest.mark.torch  # export-saelens streams through torch's TokenStream


def test_card_describes_the_folder_and_its_config_loads_the_rows(tmp_path):
    import datasets
    from huggingface_hub import DatasetCard

    with actstore.ShardWriter(
        tmp_path / "s", layers=[3], d_model=4, tokens=6, token_ids=True, model_id="tiny/llama"
    ) as w:
        w.append(np.random.default_rng(0).standard_normal((10, 1, 6, 4)), token_ids=np.arange(60).reshape(10, 6))
    actstore.finalize(tmp_path / "s")
    res = export_saelens(tmp_path / "s", tmp_path / "out", layer=3, context_size=4, seed=7, progress=False)
    card = DatasetCard.load(tmp_path / "out" / "README.md")
    meta = card.data.to_dict()
    assert meta["tags"] == ["sae-lens", "activations", "actstore"]
    assert meta["configs"] == [{"config_name": "default", "data_files": [{"split": "train", "path": "data-*.arrow"}]}]
    text = card.text
    for want in (
        "# Cached activations of `blocks.3.hook_resid_post` (tiny/llama)",
        "| context size (tokens per row) | 4 |",
        "| tokens | 60 |",
        f"| rows | {res.n_rows} |",
        "| d_in | 4 |",
        '`Array2D(shape=(4, 4), dtype="float32")`',
        "the model's vocabulary ids",
        "shuffled at token level with seed 7",
        '"exclude_special_tokens": [\n    -1\n  ]',
        'repo_type="dataset"',
        "datasets.load_from_disk(folder)",
    ):
        assert want in text, want
    files = [str(tmp_path / "out" / p["path"]) for p in meta["configs"][0]["data_files"]]
    hub = datasets.load_dataset("arrow", data_files={"train": files}, split="train")
    disk = datasets.load_from_disk(str(tmp_path / "out"))
    assert len(hub) == len(disk) == res.n_rows and hub.features == disk.features
    assert hub[0]["token_ids"] == disk[0]["token_ids"]
    assert sorted(int(t) for r in hub["token_ids"] for t in r if t >= 0) == list(range(60))
