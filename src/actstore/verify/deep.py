"""Deep checks: every published chunk read and its crc32c compared with the writer's record
(per (example, layer) from the checksums file, or per block), per-sample values, text
lines and statistics files loaded. Run only where the fast checks found the counts backed
by records and files, so damaged metadata cannot make them read or allocate without bound."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.chunkio import crc32c
from actstore.errors import ActstoreError, CorruptChunkError
from actstore.layout import keys, texts
from actstore.layout.checksum import per_sample_crc32c
from actstore.layout.records import Block
from actstore.layout.spool import overlaps
from actstore.verify.acts import ActsCheck
from actstore.verify.check import Checker, ShardCtx
from actstore.verify.report import ERROR, WARNING


def checksums(a: ActsCheck, blocks: list[Block], el: np.ndarray | None) -> None:
    """Recompute the crc32c of every (example, layer) of one activation array and of each block."""
    v, cfg, seg = a.v, a.cfg, a.seg
    L = cfg.n_layers
    buf_shape = (a.n_tc * seg.t_chunk, cfg.d_model)
    dtype = np.dtype(cfg.zarr_dtype)
    zarr_arr = None
    if a.io is None:
        import zarr

        try:
            zarr_arr = zarr.open_array(store=a.ctx.storage.zarr_store(a.array, read_only=True), mode="r")
        except Exception as e:  # noqa: BLE001 - untrusted metadata
            a.add(ERROR, "array-meta", f"array cannot be opened by zarr ({e!r})", a.akey)
            return
    for bi, b in enumerate(blocks):
        if overlaps(a.ctx.removed, b.start, b.stop):
            continue  # removed by a spool after every consumer read it
        block_crc = 0
        damaged_here = False
        for local in range(b.start, b.stop):
            rows = _read_example(a, zarr_arr, local, buf_shape, dtype)
            for lp in range(L):
                if rows is None or (local, lp) in a.bad_size:
                    damaged_here = True
                    continue
                crc = crc32c(rows[lp])
                block_crc = crc32c(rows[lp], block_crc)
                v.report.n_bytes_read += rows[lp].nbytes
                damaged_here |= _compare(a, el, local, lp, crc)
            if v.progress is not None:
                v.progress(L * int(np.prod(buf_shape)) * dtype.itemsize)
        if block_crc != b.crc32c[seg.name] and not damaged_here:
            a.add(
                ERROR,
                "block-checksum",
                f"block {bi} (examples {b.start}..{b.stop - 1} of the shard) has crc32c {block_crc:#010x}, the writer recorded "
                f"{b.crc32c[seg.name]:#010x}: "
                + (
                    "one of its chunk files was altered (this shard records no per-example checksums to say which)"
                    if el is None
                    else "the block record or the per-example checksums were altered"
                ),
                a.ctx.key(keys.BLOCKS),
            )


def _compare(a: ActsCheck, el: np.ndarray | None, local: int, lp: int, crc: int) -> bool:
    """Compare one (example, layer)'s crc32c with the record; True when it is damaged."""
    missing = (local, lp) in a.missing
    if el is None:
        return missing
    want = int(el[local, a.si, lp])
    if missing and crc == want:
        files = a.missing.pop((local, lp))
        a.add(
            WARNING,
            "missing-chunk",
            f"chunk file {files[0]} is missing, but the checksum shows zeros were written there "
            "(zarr omits chunks equal to the fill value: the shard was written with engine='zarr')",
            files[0],
            local,
            lp,
        )
        return False
    if missing:
        return True
    if crc != want:
        files = a.files(local, lp)
        where = (
            f"chunk file {keys.basename(files[0])}"
            if len(files) == 1
            else (f"one of its chunk files {', '.join(keys.basename(f) for f in files)}")
        )
        a.add(
            ERROR,
            "checksum",
            f"crc32c of (example {a.ctx.example_name(local)}, layer {a.cfg.layers[lp]}) is {crc:#010x}, "
            f"the writer recorded {want:#010x}: the bytes of {where} were altered",
            files[0],
            local,
            lp,
        )
        return True
    return False


def _read_example(
    a: ActsCheck, zarr_arr: Any, local: int, shape: tuple[int, int], dtype: np.dtype
) -> np.ndarray | None:
    """(L, n_tc * t_chunk, D) rows of one example in the stored dtype, or None if unreadable."""
    out = np.zeros((a.cfg.n_layers, *shape), dtype)
    if a.io is not None:
        for lp in range(a.cfg.n_layers):
            if (local, lp) in a.bad_size:
                continue
            try:
                a.io.read_into(local, lp, out[lp])
            except CorruptChunkError as e:
                a.bad_size.add((local, lp))
                a.add(ERROR, "chunk-size", str(e), a.files(local, lp)[0], local, lp)
        return out
    try:
        out[:, : a.seg.t_max] = zarr_arr[local]  # a copy: zarr decodes into its own buffer
    except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
        a.add(ERROR, "chunk-decode", f"example cannot be decoded by zarr ({e!r})", a.akey, local)
        return None
    return out


def per_sample_values(v: Checker, ctx: ShardCtx, array: str, blocks: list[Block], dtype: str) -> None:
    """Read a per-sample array's published values; each block's rows must match the crc32c
    its writer recorded (blocks of older writers record none); segment lengths must lie in
    0..t_max."""
    import zarr

    name, key = keys.basename(array), ctx.key(array)
    try:
        values = np.asarray(zarr.open_array(store=ctx.storage.zarr_store(array, read_only=True), mode="r")[: ctx.n])
    except Exception as e:  # noqa: BLE001 - any decoding failure of untrusted bytes is damage
        v.add(ERROR, "per-sample", f"per-sample array {name} cannot be read ({e!r})", key, shard=ctx.shard)
        return
    for b in blocks:
        want = (b.per_sample_crc32c or {}).get(name)
        if want is None or b.start >= ctx.n:
            continue
        rows = values[b.start : min(b.stop, ctx.n)]
        if b.stop <= ctx.n and per_sample_crc32c(rows, dtype) != want:
            first, last = ctx.example_name(b.start), ctx.example_name(b.stop - 1)
            v.add(
                ERROR,
                "per-sample-checksum",
                f"per-sample array {name}: the values of examples {first}..{last} do not match the crc32c their writer "
                "recorded (a value was changed on disk)",
                key,
                shard=ctx.shard,
                local=b.start,
                example=ctx.global_index(b.start),
            )
    for seg in v.cfg.segments:
        if array == keys.len_array(seg.name) and values.size and (values.min() < 0 or values.max() > seg.t_max):
            bad = int(np.flatnonzero((values < 0) | (values > seg.t_max))[0])
            v.add(
                ERROR,
                "per-sample",
                f"length {int(values[bad])} of segment {seg.name!r} lies outside 0..{seg.t_max}",
                key,
                shard=ctx.shard,
                local=bad,
                example=ctx.global_index(bad),
                segment=seg.name,
            )


def text_lines(v: Checker, ctx: ShardCtx, name: str) -> None:
    """Every published line of text `name` parses and names its example, in order."""
    rel = keys.text_file(name)
    key = ctx.key(rel)
    n_lines = 0
    for line in ctx.storage.get(rel).splitlines(keepends=True):
        if n_lines >= ctx.n:
            break
        i = n_lines
        n_lines += 1
        try:
            ok = texts.parse_line(line, key, name)[0] == i
        except ActstoreError:
            ok = False
        if not ok:
            v.add(
                ERROR,
                "text",
                f'line {i + 1} of {name}.jsonl is damaged (expected {{"{texts.INDEX}": {i}, ..., "{name}": ...}})',
                key,
                shard=ctx.shard,
                local=i,
                example=ctx.global_index(i),
            )
    if n_lines < ctx.n:
        v.add(ERROR, "text", f"{name}.jsonl has {n_lines} lines; {ctx.n} examples are published", key, shard=ctx.shard)


def load_stats(v: Checker, key: str, shard: int | None) -> None:
    """Report a statistics file that does not load."""
    from actstore.stats import RunningStats

    try:
        RunningStats.from_bytes(v.storage.get(key))
    except Exception as e:  # noqa: BLE001 - np.load of a damaged file raises many types
        v.add(ERROR, "stats", f"statistics file {keys.basename(key)} cannot be read ({e!r})", key, shard=shard)
