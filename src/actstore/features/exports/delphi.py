"""`actstore export-delphi`: every non-zero activation of a dictionary over a stored layer, as
delphi's latent cache (EleutherAI/delphi, eai-delphi 0.1.3: delphi/latents/cache.py
`save_splits` and `save_config`, read by delphi/latents/loader.py `LatentDataset`):

    OUT/<hookpoint>/<start>_<end>.safetensors   one per latent range (`n_splits` ranges, as
                                                delphi cuts them: linspace(0, F, n + 1))
        locations    (N, 3) [example, token position, latent - start], uint16 when every
                     value fits (as delphi chooses), else uint32
        activations  (N,) float16
        tokens       (n_examples, ctx_len) int32, the store's token ids (padding: pad_token_id)
    OUT/<hookpoint>/config.json                 delphi's CacheConfig fields and model_name

Rows are the example and position of `store[ex, layer]`; the tokens the loaders' default
mask leaves out (BOS, specials, chat template) have no activations unless `keep_special`.
Everything non-zero is kept (not only a top k): delphi samples its examples from quantiles
of all of them. The non-zeros go to their split files as each batch is encoded (memory stays
that of one batch; delphi's own cache holds them all), in safetensors' byte layout with the
header written last into space reserved for it (`safetensors.numpy.load_file` and delphi
read it). The folder is staged beside OUT and swapped in whole when complete.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from actstore.dtypes import f32_to_f16
from actstore.errors import FeatureError
from actstore.features.encoders.encoder import Encoder
from actstore.features.staging import staged_folder
from actstore.progress import updater
from actstore.read.api import Reader

N_SPLITS = 5  # delphi's CacheConfig default
BATCH_TOKENS = 4096  # tokens encoded at a time
KIND = "actstore export-delphi"
_DTYPES = {
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
}


def split_bounds(n_latents: int, n_splits: int) -> np.ndarray:
    """delphi's split boundaries: torch.linspace(0, F, n + 1).long() (truncated)."""
    return np.linspace(0, n_latents, n_splits + 1).astype(np.int64)


BUFFER_ROWS = 1 << 23  # non-zeros a call scatters at a time, over all splits
HEADER_BYTES = 1024  # reserved at the start of a split file for its header (8-byte length + JSON)


class DelphiWriter:
    """Writes delphi's split files while non-zero activations (example, position, latent,
    value) arrive: `add` takes them as coordinate arrays in any order within a call (calls in
    example order keep each file's rows in (example, position) order, as delphi's are) and
    appends each split's rows to its file at once; `finish` completes the files. Memory stays
    that of one call whatever the number of non-zeros.

    A split file is written in the order safetensors allows and delphi reads: the header's
    space reserved, the locations appended as they come, the activations kept in a side file
    beside it (a quarter of the bytes) and copied after them in the kernel at the end, then
    the tokens, then the header (padded with spaces to its reserved size, as the format
    permits)."""

    def __init__(self, folder: Path, n_latents: int, n_examples: int, ctx_len: int, n_splits: int = N_SPLITS) -> None:
        if not 1 <= n_splits <= n_latents:
            raise FeatureError(f"n_splits must be in 1..{n_latents} (the latents). Got {n_splits}.")
        self.bounds = split_bounds(n_latents, n_splits)
        widest = int(np.diff(self.bounds).max())
        small = max(n_examples, ctx_len, widest) <= 1 << 16
        self.loc_dtype = np.dtype(np.uint16 if small else np.uint32)
        self.split_of = np.repeat(np.arange(n_splits, dtype=np.int32), np.diff(self.bounds))
        self.counts = np.zeros(n_splits, np.int64)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.paths = [self.folder / f"{b}_{e - 1}.safetensors" for b, e in zip(self.bounds[:-1], self.bounds[1:])]
        # Two sets of row blocks, reused: one is filled while the other is written. A set has
        # a block per (scatter thread, split): the threads fill theirs from consecutive parts
        # of a call, and the write takes each split's blocks in thread order.
        self._threads = min(4, os.cpu_count() or 1) if _scatter_compiled is not None else 1
        self._bufs = [self._blocks(0) for _ in range(2)]
        self._turn = 0
        self._io: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="actstore-delphi")
        self._cpu = ThreadPoolExecutor(self._threads, thread_name_prefix="actstore-delphi-scatter")
        self._pending: Future | None = None
        self._loc: list[Any] = []
        self._act: list[Any] = []
        try:
            for path in self.paths:
                f = open(path, "w+b")
                self._loc.append(f)
                f.seek(HEADER_BYTES)
                self._act.append(open(path.with_name(f".{path.name}.activations"), "w+b"))
        except BaseException:
            self.close()
            raise

    def _blocks(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        n_splits = len(self.paths)
        return (
            np.empty((self._threads, n_splits, rows, 3), self.loc_dtype),
            np.empty((self._threads, n_splits, rows), np.uint16),
        )

    def add(self, example: np.ndarray, position: np.ndarray, latent: np.ndarray, value: np.ndarray) -> None:
        """Append non-zeros given as coordinates (equal-length arrays) to their splits' files:
        scattered (on threads) into one set of row blocks while the previous set is written."""
        example, position, latent = (np.asarray(a, np.int64) for a in (example, position, latent))
        value = np.asarray(value)
        n_splits, k = len(self.paths), self._threads
        step = max(k, BUFFER_ROWS // n_splits)  # the rows of a call's part: the buffers stay bounded
        for o in range(0, len(value), step):
            n = min(step, len(value) - o)
            rows = -(-n // k)
            loc, act = self._bufs[self._turn]
            if act.shape[2] < rows:
                loc, act = self._bufs[self._turn] = self._blocks(rows)
            counts = np.zeros((k, n_splits), np.int64)

            def scatter(t: int, o: int = o, rows: int = rows, loc: np.ndarray = loc, act: np.ndarray = act) -> None:
                p = slice(o + t * rows, min(o + (t + 1) * rows, o + n))
                _scatter(
                    example[p], position[p], latent[p], value[p], self.split_of, self.bounds, loc[t], act[t], counts[t]
                )

            for f in [self._cpu.submit(scatter, t) for t in range(k)]:
                f.result()
            self._wait()  # the other set's write: then this set goes
            self._pending = self._io.submit(self._write, loc, act, counts)
            self._turn ^= 1
            self.counts += counts.sum(axis=0)

    def _write(self, loc: np.ndarray, act: np.ndarray, counts: np.ndarray) -> None:
        for i in range(counts.shape[1]):
            for t in range(counts.shape[0]):
                c = int(counts[t, i])
                if c:
                    self._loc[i].write(memoryview(loc[t, i, :c]).cast("B"))
                    self._act[i].write(memoryview(act[t, i, :c]).cast("B"))

    def _wait(self) -> None:
        """Wait for the write in flight (its error raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def n_nonzero(self) -> int:
        return int(self.counts.sum())

    def finish(self, tokens: np.ndarray | None) -> list[Path]:
        """Complete every split file (activations, tokens, header); returns their paths."""
        try:
            self._wait()
            for i, path in enumerate(self.paths):
                n = int(self.counts[i])
                tensors: list[tuple[str, np.dtype, tuple[int, ...]]] = [
                    ("locations", self.loc_dtype, (n, 3)),
                    ("activations", np.dtype(np.float16), (n,)),
                ]
                if tokens is not None:
                    tensors.append(("tokens", np.dtype(np.int32), tokens.shape))
                f, side = self._loc[i], self._act[i]
                side.flush()
                f.flush()
                _append_file(f, side, 2 * n)
                if tokens is not None:
                    f.write(memoryview(np.ascontiguousarray(tokens, np.int32)).cast("B"))
                f.seek(0)
                f.write(_header(path, tensors, HEADER_BYTES))
        finally:
            self.close()
        return self.paths

    def close(self) -> None:
        """Close the files and drop the side files (idempotent)."""
        if self._io is not None:
            self._io.shutdown(wait=True)  # a write in flight ends before its file closes
            self._cpu.shutdown(wait=True)
            self._io = None
        for f in self._loc:
            f.close()
        for f in self._act:
            f.close()
            Path(f.name).unlink(missing_ok=True)
        self._loc, self._act = [], []


def _append_file(dst: Any, src: Any, n: int) -> None:
    """Append the first n bytes of file src to file dst (both flushed): in the kernel where it can."""
    src.seek(0)
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src.fileno(), dst.fileno(), n - done, done, dst.tell())
            if k == 0:
                break
            done += k
            dst.seek(k, os.SEEK_CUR)
    except (AttributeError, OSError) as e:  # no copy_file_range here (or not between these files)
        if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    src.seek(done)
    while done < n:
        chunk = src.read(min(n - done, 16 << 20))
        if not chunk:
            raise FeatureError(f"{src.name} ended after {done} of {n} bytes")
        dst.write(chunk)
        done += len(chunk)
    dst.flush()


def _header(path: Path, tensors: list[tuple[str, np.dtype, tuple[int, ...]]], size: int | None = None) -> bytes:
    """A safetensors header for tensors laid out in the given order: the 8-byte length, then
    the JSON padded with spaces to 8 bytes (or to `size` bytes in all)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    pad = -len(text) % 8 if size is None else size - 8 - len(text)
    if pad < 0:
        raise FeatureError(f"{path}: the safetensors header needs {len(text) + 8} bytes, more than {size}")
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad


def _scatter_py(example, position, latent, bits, split_of, bounds, loc, act, counts):  # noqa: ANN001, ANN202
    """Each non-zero (its float16 bits, uint16) appended to its split's rows of loc (splits,
    rows, 3) / act (splits, rows), in input order within a split, counts[split] advanced:
    the numpy reference of the compiled _scatter_loop."""
    split = split_of[latent]
    for s in range(loc.shape[0]):
        m = split == s
        c, k = int(counts[s]), int(m.sum())
        loc[s, c : c + k, 0] = example[m]
        loc[s, c : c + k, 1] = position[m]
        loc[s, c : c + k, 2] = latent[m] - bounds[s]
        act[s, c : c + k] = bits[m]
        counts[s] += k


def _scatter_loop(example, position, latent, bits, split_of, bounds, loc, act, counts):  # noqa: ANN001, ANN202
    """_scatter_py in one pass (compiled with numba): each non-zero written at its split's cursor."""
    for i in range(len(latent)):
        s = split_of[latent[i]]
        j = counts[s]
        counts[s] = j + 1
        loc[s, j, 0] = example[i]
        loc[s, j, 1] = position[i]
        loc[s, j, 2] = latent[i] - bounds[s]
        act[s, j] = bits[i]


try:
    import numba

    _scatter_compiled = numba.njit(nogil=True, cache=True)(_scatter_loop)
except ImportError:  # the numpy reference: the same arrays
    _scatter_compiled = None


def _scatter(example, position, latent, value, split_of, bounds, loc, act, counts) -> None:  # noqa: ANN001
    """Append each non-zero to its split's rows, its value cast to float16 once (dtypes'
    cast: numpy's rounding and overflow) by the compiled loop, else the numpy reference."""
    bits = f32_to_f16(np.asarray(value)).view(np.uint16)
    scatter = _scatter_py if _scatter_compiled is None else _scatter_compiled
    scatter(example, position, latent, bits, split_of, bounds, loc, act, counts)


def export_delphi(
    store: Reader,
    layer: int,
    encoder: Encoder,
    out: str | Path,
    *,
    hookpoint: str | None = None,
    n_splits: int = N_SPLITS,
    keep_special: bool = False,
    device: str | None = "auto",
    model_name: str | None = None,
    pad_token_id: int = 0,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Encode every token of `layer` and write delphi's latent cache into folder `out`
    (staged, swapped in whole); returns the hookpoint folder."""
    from actstore.features.topk.layerpass import pick_device
    from actstore.read.masks import leaves_out_special

    device = pick_device(device)
    encoder.check_input(int(store.d_model), f"layer {layer} of {store.path}")
    if not store.config.token_ids:
        raise FeatureError(
            f"{store.path} keeps no token ids: delphi's cache needs them (a store captured with token_ids)"
        )
    hookpoint = hookpoint or f"layers.{layer}"
    if "/" in hookpoint or hookpoint.startswith("."):
        raise FeatureError(f"the hookpoint must be a folder name (like layers.6). Got {hookpoint!r}.")
    n = len(store)
    ctx_len = sum(s.t_max for s in store.config.segments)
    tokens = np.full((n, ctx_len), pad_token_id, np.int32)
    labels = _labels(store) if leaves_out_special(store) and not keep_special else None
    with staged_folder(out, kind=KIND, overwrite=overwrite, source=store) as stage:
        writer = DelphiWriter(stage / hookpoint, encoder.n_features, n, ctx_len, n_splits)
        try:
            n_tokens = _pass(store, layer, encoder, writer, tokens, labels, device, progress)
            writer.finish(tokens)
        finally:
            writer.close()
        config = _config(store, layer, encoder, ctx_len, n_tokens, n_splits, model_name, pad_token_id)
        (stage / hookpoint / "config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")
    return Path(out) / hookpoint


def _pass(
    store: Reader,
    layer: int,
    encoder: Encoder,
    writer: DelphiWriter,
    tokens: np.ndarray,
    labels: Any,
    device: Any,
    progress: bool,
) -> int:
    """Encode every example of `layer` in batches into `writer`, its token ids into `tokens`;
    returns the number of tokens."""
    n = len(store)
    bar = updater(progress, n, "examples", "example")
    batch: list[tuple[int, np.ndarray]] = []
    size = n_tokens = 0
    for ex in range(n):
        x = np.asarray(store[ex, layer], np.float32)
        ids = store.token_ids(ex)
        tokens[ex, : len(ids)] = ids
        n_tokens += len(ids)
        batch.append((ex, x))
        size += len(x)
        if size >= BATCH_TOKENS or ex == n - 1:
            _encode(writer, encoder, batch, labels, store, device)
            batch, size = [], 0
        if bar is not None:
            bar(1)
    return n_tokens


def _config(
    store: Reader,
    layer: int,
    encoder: Encoder,
    ctx_len: int,
    n_tokens: int,
    n_splits: int,
    model_name: str | None,
    pad_token_id: int,
) -> dict[str, Any]:
    """delphi's CacheConfig fields (as its save_config writes them) and where they came from."""
    return {
        "dataset_repo": str(store.meta.get("dataset") or store.path),
        "dataset_split": "",
        "dataset_name": "",
        "dataset_column": "text",
        "batch_size": 1,
        "cache_ctx_len": ctx_len,
        "n_tokens": n_tokens,
        "n_splits": n_splits,
        "model_name": model_name or str(store.meta.get("model_id") or ""),
        "pad_token_id": pad_token_id,
        "actstore": {"store": str(store.path), "layer": layer, "encoder": encoder.describe()},
    }


def _labels(store: Reader) -> list[np.ndarray]:
    from actstore.layout import spec

    return [np.asarray(store.field(s + spec.TOKEN_LABELS_SUFFIX)) for s in store.segments]


def _encode(writer: DelphiWriter, encoder: Encoder, batch: list, labels: Any, store: Reader, device: Any) -> None:
    """Encode a batch of examples and keep its non-zeros (the left-out tokens' dropped)."""
    x = np.concatenate([b[1] for b in batch])
    ex = np.concatenate([np.full(len(b[1]), b[0], np.int64) for b in batch])
    pos = np.concatenate([np.arange(len(b[1]), dtype=np.int64) for b in batch])
    if labels is not None:
        keep = np.concatenate([_content(store, labels, b[0]) for b in batch])
        x, ex, pos = x[keep], ex[keep], pos[keep]
    z = encoder.encode(x, device=device)
    r, c = np.nonzero(z)
    writer.add(ex[r], pos[r], c, z[r, c])


def _content(store: Reader, labels: list[np.ndarray], ex: int) -> np.ndarray:
    lengths = store.lengths(ex)
    return np.concatenate([lab[ex, : lengths[s]] == 0 for lab, s in zip(labels, store.segments)])
