"""Golden actstore stores: tiny stores of each layout, written with today's public API.

Regenerate every store golden (only after a deliberate format change) with one command:

    .venv/bin/python tests/golden/make_store_golden.py

It writes `tests/golden/<name>.tar.xz` for each name in `STORES`. tests/test_store_golden.py
imports this module: it reads each archive through ActStore and zarr-python and compares it
with `expected(name)`, and writes each store again with `write_store` to compare every file
byte for byte.

Volatile fields: the writer stamps `created` (shard attributes, manifest), `updated`
(commit.json) and `actstore_version` (shard attributes, manifest) with the time and the
package version. `normalise` rewrites those values, wherever they occur in a metadata
file (`*.json`, `.zattrs`, `.zmetadata`; text/*.jsonl is user data and is left alone),
to `FIXED_TIME` and `FIXED_VERSION`, textually, so every other byte stays as the writer
wrote it. `write_store` normalises what it writes, so the archives hold normalised stores
and a regeneration without a format change reproduces the same files. Nothing else
varies: the statistics .npz files are deterministic (numpy writes zip members through
`ZipFile.open(name, "w")`, which stamps the fixed zip epoch 1980-01-01, not the clock),
so the content-named `stats-<crc32c>.npz` is too.

Sizes: per-sample arrays are chunked at up to 65,536 rows, so a tiny store still holds
multi-MB chunk files of zeros; the archives (xz) are a few KB each. They are
deterministic: sorted members, mtime 0, uid/gid 0, no user or group names.

Values are exact in the stored dtype (multiples of 0.25 below 32 in magnitude, exact in
float16 and bfloat16), so `expected(name)` is what a reader must return, bit for bit.
"""

from __future__ import annotations

import io
import lzma
import re
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

import actstore
import actstore.verify

GOLDEN = Path(__file__).resolve().parent
FIXED_TIME = "2000-01-01T00:00:00Z"
FIXED_VERSION = "0.0.0+golden"
_VOLATILE = re.compile(rb'("(?:created|updated)"\s*:\s*)"[^"\\]*"')
_VERSION = re.compile(rb'("actstore_version"\s*:\s*)"[^"\\]*"')
_METADATA_NAMES = (".zattrs", ".zmetadata")


@dataclass
class Expected:
    """What a reader must return from a golden store (activations as float32 values).

    `acts[segment]` is (n, L, T_max, D), zero beyond each example's length;
    `token_labels[segment]` is (n, T_max) uint8, zero beyond what was given.
    """

    layers: list[int]
    d_model: int
    dtype: str
    zarr_format: int
    segments: dict[str, dict[str, Any]]  # name -> {"t_max", "t_chunk", "fixed"} (store.meta's view)
    shards: list[tuple[int, int]]  # (shard number, examples), ascending
    acts: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    sample_keys: list[str]
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    texts: dict[str, list[Any]] = field(default_factory=dict)
    token_labels: dict[str, np.ndarray] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    model_id: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    stats: bool = False

    @property
    def n_examples(self) -> int:
        return len(self.sample_keys)


def _values(shape: tuple[int, ...], offset: int) -> np.ndarray:
    """Multiples of 0.25 in [-31.25, 31.25]: exact in float16, bfloat16 and float32."""
    k = (np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + offset) % 251 - 125
    return (k.astype(np.float32) * 0.25).reshape(shape)


def _masked(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Zero (n, L, T, D) activations past each example's length (the stored padding)."""
    keep = np.arange(x.shape[2])[None, :] < lengths[:, None]
    return x * keep[:, None, :, None]


# ---- the stores ----------------------------------------------------------------------
def _qa_v2(path: Path) -> Expected:
    """Zarr v2, segments prompt (5) + response (3, chunks of 2: an edge chunk), two writer
    shards, three commits in shard 0, a field, a text, token labels, truncation, stats."""
    layers, D, P, R = [1, 3], 8, 5, 3
    n = 11
    src_p = np.array([5, 9, 2, 4, 1, 6, 3, 4, 5, 2, 7], np.int32)  # source lengths: > 5 is truncated
    src_r = np.array([3, 0, 2, 2, 1, 3, 3, 0, 1, 2, 8], np.int32)
    len_p, len_r = np.minimum(src_p, P), np.minimum(src_r, R)
    prompt = _masked(_values((n, 2, P, D), 3), len_p)
    response = _masked(_values((n, 2, R, D), 101), len_r)
    lab_p = ((np.arange(n * P).reshape(n, P) % 5 + 1) * (np.arange(P)[None] < len_p[:, None])).astype(np.uint8)
    lab_r = ((np.arange(n * R).reshape(n, R) % 3 + 7) * (np.arange(R)[None] < len_r[:, None])).astype(np.uint8)
    keys = [f"qa-{i:03d}" for i in range(n)]
    keys[4] = "clé-4 ☃"  # non-ASCII: stored as its UTF-8 bytes
    label = np.array([3, -1, 0, 7, 32767, -32768, 5, 2, 1, 0, -7], np.int16)
    prompts = [f"question {i}?" for i in range(n)]
    prompts[2] = "naïve ☃ \"quoted\"\nnew line"
    # (shard, [(start, stop, prompt tokens in the batch, response tokens in the batch)], commit after batches)
    plan = [(0, [(0, 3, 5, 3), (3, 5, 4, 2), (5, 7, 5, 3)], {0, 1}), (1, [(7, 11, 5, 3)], set())]
    kw = dict(layers=layers, d_model=D, segments={"prompt": P, "response": R}, t_chunk={"response": 2},
              fields={"label": "int16"}, texts=["prompt"], token_labels=True, stats=True, zarr_format=2,
              model_id="golden/qa-llm", attrs={"dataset": "golden-qa", "family": "llm"})
    for shard, batches, commits in plan:
        with actstore.ShardWriter(path, shard=shard, **kw) as w:
            for k, (a, b, tp, tr) in enumerate(batches):
                assert (len_p[a:b] <= tp).all() and (len_r[a:b] <= tr).all()
                w.append(
                    prompt=prompt[a:b, :, :tp], response=response[a:b, :, :tr],
                    lengths={"prompt": len_p[a:b], "response": len_r[a:b]},
                    source_lengths={"prompt": src_p[a:b], "response": src_r[a:b]},
                    token_labels={"prompt": lab_p[a:b, :tp], "response": lab_r[a:b, :tr]},
                    sample_keys=keys[a:b], fields={"label": label[a:b]}, texts={"prompt": prompts[a:b]},
                )
                if k in commits:
                    w.commit()
    return Expected(
        layers=layers, d_model=D, dtype="float16", zarr_format=2,
        segments={"prompt": {"t_max": P, "t_chunk": P, "fixed": False}, "response": {"t_max": R, "t_chunk": 2, "fixed": False}},
        shards=[(0, 7), (1, 4)], acts={"prompt": prompt, "response": response},
        lengths={"prompt": len_p, "response": len_r}, sample_keys=keys, fields={"label": label},
        texts={"prompt": prompts}, token_labels={"prompt": lab_p, "response": lab_r},
        truncated={"prompt": int((src_p > P).sum()), "response": int((src_r > R).sum())},
        model_id="golden/qa-llm", attrs={"dataset": "golden-qa", "family": "llm"}, stats=True,
    )


def _fixed(path: Path, *, n: int, batches: list[int], commits: set[int], layers: list[int], T: int,
           dtype: str, zarr_format: int, offset: int, t_chunk: int | None = None,
           shard_examples: int | None = None, stats: bool = False, name: str) -> Expected:
    """One fixed segment `tokens`, one writer shard, a per-sample int8 field."""
    D = 8
    x = _values((n, len(layers), T, D), offset)
    keys = [f"{name}/ex{i}" for i in range(n)]
    split = (np.arange(n) % 3 - 1).astype(np.int8)
    attrs = {"cls_token": True, "dataset": f"golden-{name}"}
    with actstore.ShardWriter(path, layers=layers, d_model=D, tokens=T, dtype=dtype, t_chunk=t_chunk,
                              zarr_format=zarr_format, shard_examples=shard_examples, fields={"split": "int8"},
                              stats=stats, model_id=f"golden/{name}", attrs=attrs) as w:
        a = 0
        for k, b in enumerate(batches):
            w.append(x[a : a + b], sample_keys=keys[a : a + b], fields={"split": split[a : a + b]})
            a += b
            if k in commits:
                w.commit()
    assert a == n
    return Expected(
        layers=layers, d_model=D, dtype=dtype, zarr_format=zarr_format,
        segments={"tokens": {"t_max": T, "t_chunk": t_chunk or T, "fixed": True}}, shards=[(0, n)],
        acts={"tokens": x}, lengths={"tokens": np.full(n, T, np.int32)}, sample_keys=keys,
        fields={"split": split}, truncated={"tokens": 0}, model_id=f"golden/{name}", attrs=attrs, stats=stats,
    )


STORES: dict[str, Callable[[Path], Expected]] = {
    # Zarr v2 flat chunk files, two variable-length segments, everything per sample.
    "store-v2": _qa_v2,
    # Zarr v3 unsharded (c/<i>/<l>/<t>/0), float16, token chunks of 3 over 4 tokens (an edge chunk).
    "store-v3": lambda p: _fixed(p, n=5, batches=[2, 3], commits=set(), layers=[0, 2], T=4, dtype="float16",
                                 zarr_format=3, offset=11, t_chunk=3, stats=True, name="v3"),
    # Zarr v3 sharding codec, 4 examples per shard file, 10 examples (last file partial); the
    # commit after 6 examples writes a partial shard file that is replaced whole once it fills.
    "store-v3-sharded": lambda p: _fixed(p, n=10, batches=[3, 3, 4], commits={1}, layers=[1, 3], T=4,
                                         dtype="float16", zarr_format=3, offset=29, shard_examples=4,
                                         stats=True, name="v3s"),
    # bfloat16 on disk as <u2 bit patterns (Zarr v2).
    "store-bf16": lambda p: _fixed(p, n=4, batches=[4], commits=set(), layers=[2], T=3, dtype="bfloat16",
                                   zarr_format=2, offset=47, stats=True, name="bf16"),
    # float32 (Zarr v2).
    "store-f32": lambda p: _fixed(p, n=3, batches=[1, 2], commits=set(), layers=[0, 5], T=2, dtype="float32",
                                  zarr_format=2, offset=61, name="f32"),
}


def expected(name: str) -> Expected:
    """The values a golden store holds (writes it to a temporary folder to build them)."""
    with tempfile.TemporaryDirectory() as tmp:
        return STORES[name](Path(tmp) / name)


def write_store(name: str, path: Path) -> Expected:
    """Write golden store `name` at `path` with today's writer, finalize and normalise it."""
    exp = STORES[name](path)
    actstore.finalize(path)
    normalise(path)
    return exp


def is_metadata(rel: str) -> bool:
    """Metadata files that may hold volatile fields (never text/*.jsonl: user data)."""
    base = rel.rsplit("/", 1)[-1]
    return (base.endswith(".json") or base in _METADATA_NAMES) and "/text/" not in f"/{rel}"


def normalise(root: Path) -> None:
    """Rewrite `created`, `updated` and `actstore_version` values to fixed ones, in place."""
    for p in sorted(root.rglob("*")):
        if p.is_file() and is_metadata(p.relative_to(root).as_posix()):
            data = p.read_bytes()
            new = _VOLATILE.sub(rb'\1"' + FIXED_TIME.encode() + rb'"', data)
            new = _VERSION.sub(rb'\1"' + FIXED_VERSION.encode() + rb'"', new)
            if new != data:
                p.write_bytes(new)


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by POSIX path relative to it."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def pack(root: Path, archive: Path) -> None:
    """A deterministic tar.xz of `root` (members under `root.name`/, sorted, no owners or times)."""
    paths = [root, *sorted(root.rglob("*"))]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in paths:
            info = tarfile.TarInfo((Path(root.name) / p.relative_to(root)).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if p.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = p.read_bytes()
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    archive.write_bytes(lzma.compress(buf.getvalue(), preset=9))


def unpack(archive: Path, dest: Path) -> Path:
    """Extract a golden archive into `dest`; returns the store's root folder."""
    with tarfile.open(archive, mode="r:xz") as tar:
        tar.extractall(dest, filter="data")
    return dest / archive.name.removesuffix(".tar.xz")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name in STORES:
            root = Path(tmp) / name
            write_store(name, root)
            report = actstore.verify.verify_store(root, deep=True)
            if report.problems:
                print(f"{name}: verify found {report.problems}", file=sys.stderr)
                return 1
            out = GOLDEN / f"{name}.tar.xz"
            pack(root, out)
            raw = sum(len(b) for b in files(root).values())
            print(f"wrote {out.relative_to(GOLDEN.parent.parent)} ({out.stat().st_size} bytes; store {raw} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
