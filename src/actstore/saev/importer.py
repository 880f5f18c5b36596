"""import_saev: a saev 2.0 / 2.1 shard directory -> an actstore store (through ShardWriter)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.read.saevstore import SaevStore
from actstore.saev import checksums
from actstore.write import ShardWriter
from actstore.write.finalize import finalize

DEFAULT_BATCH_BYTES = 64 * 2**20


def import_saev(
    saev_dir: str | os.PathLike,
    store: str | os.PathLike,
    *,
    dtype: str = "float32",
    shard: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> Any:
    """Convert a saev shard directory into a finalized actstore store; returns the ActStore.

    The store has one fixed segment "tokens" of T tokens (CLS at token 0 when the
    directory has one), the directory's layers and d_model, per-token labels when
    labels.bin exists (label 0 at CLS), and attrs family, ckpt, cls_token, dataset, data
    (and pixel_agg), so that exporting it again with the same protocol and budget gives
    the same directory. A directory with export-saev's checksum sidecar is checked against
    it first (SaevFormatError naming each changed file).

    Args:
        saev_dir: the `<HASH>` directory.
        store: the new store's root (must not hold a store yet, unless `overwrite`).
        dtype: stored dtype: "float32" (default, lossless), "float16" or "bfloat16".
        shard: the writer shard number to use.
        overwrite: replace shard `shard` if the store already has it.
        progress: show a progress bar.
        batch_bytes: float32 bytes appended per batch.
    """
    from actstore.progress import bar as progress_bar  # a live bar on a terminal, lines in a pipe
    from actstore.read.store import ActStore

    src = SaevStore(saev_dir)
    checksums.require(saev_dir)  # an export's sidecar, when present: a changed byte is refused, not copied
    g = src.geometry
    cfg = src.config
    labels = src.labels() if cfg.token_labels else None
    batch = max(1, int(batch_bytes) // g.example_nbytes)
    w = ShardWriter(
        store,
        shard=shard,
        layers=cfg.layers,
        d_model=cfg.d_model,
        tokens=g.tokens_per_example,
        dtype=dtype,
        token_labels=cfg.token_labels,
        model_id=cfg.model_id,
        attrs=dict(cfg.attrs),
        overwrite=overwrite,
    )
    with (
        w,
        progress_bar(
            total=len(src), unit="ex", desc=f"import saev {Path(saev_dir).name[:8]}", disable=not progress
        ) as bar,
    ):
        for start in range(0, len(src), batch):
            stop = min(start + batch, len(src))
            acts = _examples(src, start, stop)
            kw = {}
            if labels is not None:
                lab = np.zeros((stop - start, g.tokens_per_example), dtype=np.uint8)
                lab[:, int(g.cls_token) :] = labels[start:stop]
                kw["token_labels"] = lab
            w.append(acts, **kw)
            bar.update(stop - start)
    finalize(store)
    return ActStore(store)


def _examples(src: SaevStore, start: int, stop: int) -> np.ndarray:
    """(b, L, T, D) float32 of examples [start, stop), which may span shard files."""
    parts = []
    ex = start
    while ex < stop:
        pos, local = src.index.locate(ex)
        n = min(stop - ex, int(src.index.counts[pos]) - local)
        parts.append(src.shard_map(pos)[local : local + n])
        ex += n
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
