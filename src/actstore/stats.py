"""Running activation statistics: exact per-batch moments merged with Chan's formula.

One accumulator keeps, for each (layer, segment) key, over the token vectors it is given
(ShardWriter gives the real tokens that the readers' default mask keeps: only content
tokens, label 0, of a text store whose labels mark token kinds; actstore.read.masks):
count, per-dimension mean and M2 (sum of squared deviations; variance = M2 / count),
the sum of L2 norms, the min and max element, the count of vectors that held a
non-finite value (those are left out of the moments), and the count of values that
overflowed the stored dtype (clipped; counted by capture, see `add_overflow`).
Everything is float64. Merging two accumulators (blocks, writer shards) gives the same result as one pass over all data, up
to float64 rounding.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from actstore.dtypes import to_f64

_FIELDS = ("count", "mean", "m2", "norm_sum", "min", "max", "nonfinite", "overflow")
_OPTIONAL_FIELDS = ("overflow",)  # absent from files written before it existed: zeros


class RunningStats:
    """Statistics for `keys` (e.g. "layer6/prompt") over d_model-dimensional vectors."""

    def __init__(self, keys: Sequence[str], d_model: int):
        self.keys = list(keys)
        k = len(self.keys)
        self.d_model = d_model
        self.count = np.zeros(k, np.int64)
        self.mean = np.zeros((k, d_model), np.float64)
        self.m2 = np.zeros((k, d_model), np.float64)
        self.norm_sum = np.zeros(k, np.float64)
        self.min = np.full(k, np.inf)
        self.max = np.full(k, -np.inf)
        self.nonfinite = np.zeros(k, np.int64)
        self.overflow = np.zeros(k, np.int64)
        self._pos = {key: i for i, key in enumerate(self.keys)}

    def update(self, key: str, vectors_nd: np.ndarray) -> None:
        """Add a batch of vectors (n, d_model) of any float dtype under `key`."""
        k = self._pos[key]
        x = to_f64(vectors_nd)  # a private copy: turned into deviations in place
        if x.shape[0] == 0:
            return
        sq = np.einsum("nd,nd->n", x, x)  # squared L2 norms; not finite where a row is not
        if not np.isfinite(sq).all():
            finite = np.isfinite(x).all(axis=1)  # exact (a huge finite row can square to inf)
            bad = int(x.shape[0] - np.count_nonzero(finite))
            self.nonfinite[k] += bad
            x = x[finite]
            if x.shape[0] == 0:
                return
            sq = np.einsum("nd,nd->n", x, x)
        n = x.shape[0]
        mean = x.mean(axis=0)
        lo, hi = float(x.min()), float(x.max())
        np.subtract(x, mean, out=x)
        m2 = np.einsum("nd,nd->d", x, x)
        self._merge_one(k, n, mean, m2, float(np.sqrt(sq).sum()), lo, hi)

    def _merge_one(
        self, k: int, n: int, mean: np.ndarray, m2: np.ndarray, norm_sum: float, lo: float, hi: float
    ) -> None:
        na = int(self.count[k])
        total = na + n
        delta = mean - self.mean[k]
        self.mean[k] += delta * (n / total)
        self.m2[k] += m2 + delta * delta * (na * n / total)
        self.count[k] = total
        self.norm_sum[k] += norm_sum
        self.min[k] = min(self.min[k], lo)
        self.max[k] = max(self.max[k], hi)

    def merge(self, other: RunningStats) -> None:
        """Fold `other` (same keys and d_model) into this accumulator."""
        if other.keys != self.keys or other.d_model != self.d_model:
            raise ValueError(f"cannot merge statistics over keys {other.keys} into {self.keys}")
        for k in range(len(self.keys)):
            self.nonfinite[k] += other.nonfinite[k]
            self.overflow[k] += other.overflow[k]
            if other.count[k]:
                self._merge_one(
                    k, int(other.count[k]), other.mean[k], other.m2[k], other.norm_sum[k], other.min[k], other.max[k]
                )

    def add_overflow(self, key: str, n: int) -> None:
        """Count `n` values under `key` that overflowed the stored dtype (and were clipped)."""
        self.overflow[self._pos[key]] += int(n)

    def variance(self, key: str) -> np.ndarray:
        k = self._pos[key]
        return self.m2[k] / max(int(self.count[k]), 1)

    def summary(self) -> dict[str, dict[str, float]]:
        """Scalars per key, for `actstore info`."""
        out = {}
        for k, key in enumerate(self.keys):
            n = int(self.count[k])
            out[key] = {
                "count": n,
                "mean_norm": float(self.norm_sum[k] / n) if n else float("nan"),
                "mean_of_mean": float(self.mean[k].mean()) if n else float("nan"),
                "mean_std": float(np.sqrt(self.m2[k] / n).mean()) if n else float("nan"),
                "min": float(self.min[k]) if n else float("nan"),
                "max": float(self.max[k]) if n else float("nan"),
                "nonfinite": int(self.nonfinite[k]),
                "overflow": int(self.overflow[k]),
            }
        return out

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, keys=np.array(self.keys), **{f: getattr(self, f) for f in _FIELDS})
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunningStats:
        """A statistics .npz's bytes; damage of any kind raises ValueError."""
        import zipfile

        try:
            _check_npz(data)
            return cls.load(io.BytesIO(data))
        except (
            zipfile.BadZipFile,
            NotImplementedError,
            RuntimeError,
            EOFError,
            OSError,
            KeyError,
            TypeError,
            IndexError,
        ) as e:
            raise ValueError(f"not a readable statistics file ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: Any) -> RunningStats:
        """Read a statistics .npz (a path or a binary file object)."""
        with np.load(path, allow_pickle=False) as z:
            keys = [str(k) for k in z["keys"]]
            st = cls(keys, int(z["mean"].shape[1]))
            for f in _FIELDS:
                if f in _OPTIONAL_FIELDS and f not in z.files:
                    continue
                arr = z[f]
                if arr.shape != getattr(st, f).shape:
                    raise ValueError(f"statistics file {path} has field {f} of shape {arr.shape}")
                setattr(st, f, arr.astype(getattr(st, f).dtype))
        return st


def _check_npz(data: bytes) -> None:
    """Refuse a statistics file whose arrays claim more bytes than the file holds, before
    numpy allocates them: np.savez stores its members uncompressed, so each array's header
    shape x itemsize must fit in its member (a few KB claiming 10**12 values would make
    np.load allocate them). Damage raises ValueError."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                raise ValueError(
                    f"member {info.filename} is compressed or larger than the file; np.savez writes neither"
                )
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0), (3, 0)):
                    raise ValueError(f"member {info.filename} has npy format version {version}")
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
                if dtype.hasobject or int(np.prod(shape, dtype=object)) * dtype.itemsize > info.file_size:
                    raise ValueError(
                        f"member {info.filename} claims {shape} values of {dtype}, more than its {info.file_size} bytes"
                    )


def stats_key(layer: int, segment: str) -> str:
    return f"layer{layer}/{segment}"


def read_stats(storage, key: str, *, then: str) -> RunningStats:
    """A statistics file read through a Storage; a damaged one is a CorruptStoreError."""
    import zipfile

    from actstore.errors import CorruptStoreError

    try:
        return RunningStats.from_bytes(storage.get(key))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a damaged .npz raises any of these
        why = str(e) if type(e) is ValueError else repr(e)  # from_bytes says what was wrong
        raise CorruptStoreError(f"statistics file {storage.where(key)} is unreadable ({why}); {then}") from None


def update_masked(
    stats: RunningStats, cfg: Any, seg: Any, arr: np.ndarray, lens: np.ndarray, labels: np.ndarray | None = None
) -> None:
    """Add a batch (b, L, T_max, D) of segment `seg` to `stats`: the tokens the readers'
    default mask keeps (actstore.read.masks), i.e. real tokens, and of those only content
    (label 0) where `labels` mark token kinds."""
    for lp, layer in enumerate(cfg.layers):
        xl = arr[:, lp][:, : seg.t_max]  # (an array, or one layer of a write.batch.LayerList)
        if cfg.dtype == "bfloat16":
            from actstore.dtypes import bf16_bits_to_f32

            xl = bf16_bits_to_f32(xl)
        if labels is None and (lens == seg.t_max).all():
            v = xl.reshape(-1, cfg.d_model)
        else:
            mask = np.arange(seg.t_max)[None, :] < lens[:, None]
            if labels is not None:
                mask &= labels[:, : seg.t_max] == 0
            v = xl[mask]
        stats.update(stats_key(layer, seg.name), v)
