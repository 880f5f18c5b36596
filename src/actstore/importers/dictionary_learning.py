"""`actstore import-dictionary-learning`: one submodule's activation cache of
dictionary_learning (saprmarks/dictionary_learning, cache.py `ActivationCache.collect`) ->
an actstore store.

The cache, per submodule, in `{store_dir}/{submodule_name}_{io}/`:
- `shard_{i}.memmap`: raw float32 (N_i, d_model), tokens with padding removed, batches
  flattened (no sequence boundaries, no token ids), shuffled within the shard when
  `shuffle_shards` (each submodule with its own unseeded permutation);
- `shard_{i}.meta`: {"shape": [N_i, d_model]};
- `config.json`: {batch_size, context_len, shard_size, d_model, shuffle_shards, io,
  total_size, shard_count}. `collect` writes its last shard after the loop without counting
  it: `shard_count` and `total_size` leave it out, and ActivationCache never reads it. The
  import takes every shard present (0, 1, ... without gaps) and says so.

Mapping: tokens in file order, cut into examples of `tokens_per_example` tokens (default
`context_len`; the last example of a shard may be shorter) of the segment "tokens"; one
layer (--layer, else the last number in the folder's name, else 0); float32, exact. Each
shard file becomes one writer shard (driver.py). The cache holds no token ids, so stores
imported from two submodules cannot be checked for alignment by ids (and are not aligned
at all when `shuffle_shards` was on).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from actstore.errors import DictionaryLearningCacheError
from actstore.importers.driver import Examples, Geometry, Part
from actstore.importers.files import local_file, local_size, read_bytes
from actstore.storage import KeyNotFound, open_storage

CONFIG = "config.json"
BATCH_TOKENS = 1 << 16  # tokens appended per batch (a window of the memory map)


class DictionaryLearningSource:
    """One submodule folder of a dictionary_learning activation cache (a local folder).

    Args:
        src: the folder `{store_dir}/{submodule_name}_{io}`.
        tokens_per_example: tokens per example (default: the cache's context_len).
        layer: the store's layer number (default: the last number in the folder's name).
    """

    kind = "dictionary-learning"

    def __init__(self, src: Any, *, tokens_per_example: int | None = None, layer: int | None = None):
        storage = open_storage(src)
        if storage.local_root is None:
            raise DictionaryLearningCacheError(
                f"{storage.url}: dictionary_learning caches are memory-mapped local files; "
                "copy the folder to a local disk first"
            )
        self.storage, self.url, self.root = storage, storage.url.rstrip("/"), storage.local_root
        self.config = cfg = self._json(CONFIG)
        for k in ("d_model", "context_len", "shard_count", "total_size"):
            v = cfg.get(k) if isinstance(cfg, dict) else None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (k in ("d_model", "context_len") and v == 0):
                raise DictionaryLearningCacheError(
                    f"{self.url}/{CONFIG}: {k} must be a {'positive' if k in ('d_model', 'context_len') else 'non-negative'} int. Got {v!r}."
                )
        self.d = cfg["d_model"]
        T = tokens_per_example or cfg["context_len"]
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"tokens_per_example must be a positive int. Got {T!r}.")
        self.T = T
        self.parts, self.shapes = [], []
        names = set(storage.list_dir(""))
        i = 0
        while f"shard_{i}.memmap" in names or f"shard_{i}.meta" in names:
            n = self._shard_rows(i, names)
            self.shapes.append(n)
            self.parts.append(Part(key=f"shard_{i}.memmap", n_examples=-(-n // T), fingerprint=f"{n * self.d * 4}"))
            i += 1
        strays = sorted(
            x for x in names if re.fullmatch(r"shard_\d+\.(memmap|meta)", x) and int(re.findall(r"\d+", x)[0]) >= i
        )
        if strays:
            raise DictionaryLearningCacheError(
                f"{self.url} holds {strays} but no shard_{i}.memmap/.meta: a shard is missing"
            )
        if i < cfg["shard_count"]:
            raise DictionaryLearningCacheError(
                f"{self.url}/{CONFIG} says shard_count {cfg['shard_count']}, but only {i} shards are here"
            )
        if layer is None:
            nums = re.findall(r"\d+", self.url.rsplit("/", 1)[-1])
            layer = int(nums[-1]) if nums else 0
        self.note = (
            f"{i - cfg['shard_count']} shard(s) beyond config.json's shard_count (collect's last shard, never counted)"
            if i > cfg["shard_count"]
            else None
        )
        self.geometry = Geometry(
            layers=[int(layer)],
            d_model=self.d,
            tokens=T,
            dtype="float32",
            variable=True,
            attrs={
                "dictionary_learning": {
                    "config": cfg,
                    "folder": self.url.rsplit("/", 1)[-1],
                    "n_shards": i,
                    "note": self.note,
                }
            },
        )

    def _json(self, key: str) -> Any:
        try:
            raw = read_bytes(self.storage, key, self.url, 1 << 20, DictionaryLearningCacheError)
        except KeyNotFound:
            raise DictionaryLearningCacheError(
                f"{self.url}/{key} is missing: pass one submodule's folder "
                "{store_dir}/{submodule}_{io} of a dictionary_learning activation cache"
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DictionaryLearningCacheError(f"{self.url}/{key} is not valid JSON ({e})") from None

    def _shard_rows(self, i: int, names: set[str]) -> int:
        """Rows of shard i, its .meta checked against config.json and the file's size."""
        meta, data = f"shard_{i}.meta", f"shard_{i}.memmap"
        for k in (meta, data):
            if k not in names:
                raise DictionaryLearningCacheError(f"{self.url}/{k} is missing (its pair is here)")
        shape = (self._json(meta) or {}).get("shape") if isinstance(self._json(meta), dict) else None
        if (
            not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) and x >= 0 for x in shape))
            or shape[1] != self.d
        ):
            raise DictionaryLearningCacheError(
                f"{self.url}/{meta}: shape {shape!r}; expected [n_tokens, {self.d}] (d_model of {CONFIG})"
            )
        size = local_size(self.storage, data, self.url, DictionaryLearningCacheError)
        if size != shape[0] * self.d * 4 and not (shape[0] == 0 and size <= 1):  # numpy maps 0 rows as 1 byte
            raise DictionaryLearningCacheError(
                f"{self.url}/{data} has {size} bytes; {meta} says {shape[0]} x {self.d} float32 = "
                f"{shape[0] * self.d * 4} bytes (truncated or replaced?)"
            )
        return shape[0]

    def read(self, part: Part, start: int) -> Iterator[Examples]:
        i = self.parts.index(part)
        n, T, D = self.shapes[i], self.T, self.d
        if n == 0:
            return  # an empty shard (collect's last one, when the tokens filled the others): no example
        path = local_file(self.storage, part.key, self.url, DictionaryLearningCacheError)
        try:
            mm = np.memmap(path, dtype=np.float32, mode="r", shape=(n, D))
        except (OSError, ValueError) as e:
            raise DictionaryLearningCacheError(f"{self.url}/{part.key} cannot be memory-mapped ({e})") from None
        per = max(1, BATCH_TOKENS // T)
        for e0 in range(start, part.n_examples, per):
            e1 = min(e0 + per, part.n_examples)
            t0, t1 = e0 * T, min(e1 * T, n)
            acts = np.zeros((e1 - e0, 1, T, D), np.float32)
            acts.reshape(-1, D)[: t1 - t0] = mm[t0:t1]  # one copy out of the map (the last example padded)
            lengths = np.full(e1 - e0, T, np.int64)
            lengths[-1] = t1 - (e1 - 1) * T
            yield Examples(acts=acts, lengths=lengths)
