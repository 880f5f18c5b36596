"""`verify_saev`: check a saev 2.0 / 2.1 shard directory against every rule of its protocol."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from actstore.layout import saevspec as P
from actstore.read.saevschema import check_metadata, check_shards_json, read_json, regular_size
from actstore.saev import checksums
from actstore.storage.swap import STAGE_MARKER

_BLOCK = 16 * 2**20  # bytes per read when scanning padding or values


@dataclass
class SaevReport:
    """The outcome of verify_saev: `ok` when `problems` is empty."""

    path: Path
    protocol: str | None = None
    metadata: dict | None = None
    geometry: P.ShardGeometry | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_saev(
    path: str | os.PathLike,
    *,
    values: bool = False,
    progress: bool = False,
    published_as: str | os.PathLike | None = None,
) -> SaevReport:
    """Check a saev shard directory; every violation is listed, none raised.

    Rules: metadata fields, types and order (2.1); the directory name equals the metadata
    hash; 2.1 sits at .../saev/shards/<hash>; shards.json names and counts; every shard
    file exists at full size; the last shard's padding is zeros; labels.bin size; no stray
    files; with `values`, every stored value is finite and, where export-saev left its checksum
    sidecar (actstore_checksums.json), every file matches its recorded size and crc32c.

    Args:
        path: the `<HASH>` directory.
        values: also read every activation and check that it is finite (slow: reads all).
        progress: show a progress bar while reading values.
        published_as: the `<HASH>` path a directory still being built will be published
            as (its name and location are checked as that path's).
    """
    root = Path(path)
    named = Path(published_as) if published_as is not None else root
    report = SaevReport(path=root)
    if not root.is_dir():
        report.problems.append(f"{root}: not a directory")
        return report
    md, problem = read_json(root / P.METADATA_FILE)
    if problem:
        from actstore.layout import keys

        if any((root / k).exists() for k in (keys.MANIFEST, keys.IDENTITY)):
            problem = f"{root} is an actstore store, not a saev shard directory: check it with `actstore verify {root}`"
        report.problems.append(problem)
        return report
    proto, geom, problems = check_metadata(md)
    report.protocol, report.metadata, report.geometry = proto, md, geom
    report.problems += problems
    if proto is None:
        return report
    if not problems:
        want = P.metadata_hash(md, proto)
        if named.name != want:
            report.problems.append(
                f"directory name {named.name!r} is not the metadata hash {want!r} ({P.HASH_RULE[proto]}): "
                "metadata.json was edited or the directory renamed"
            )
    if proto == "2.1" and Path(os.path.abspath(named)).parts[-3:-1] != P.SHARDS_ROOT_PARTS:
        report.problems.append(
            f"location: protocol 2.1 directories must sit at .../saev/shards/<hash> (saev's loaders check); this one is {root}"
        )
    entries, problem = read_json(root / P.SHARDS_FILE)
    names: list[str] = []
    if problem:
        report.problems.append(problem)
    else:
        names, problems = check_shards_json(entries, geom, proto)
        report.problems += problems
    staged = published_as is not None  # a stage holds its marker until it is swapped in
    report.problems += _check_files(
        root, names, geom, md.get("layers"), values=values, progress=progress, staged=staged
    )
    return report


def _check_files(
    root: Path,
    names: list[str],
    geom: P.ShardGeometry | None,
    layers: list,
    *,
    values: bool,
    progress: bool,
    staged: bool = False,
) -> list[str]:
    problems = []
    allowed = {P.METADATA_FILE, P.SHARDS_FILE, P.LABELS_FILE, P.OFFSETS_FILE, P.CHECKSUMS_FILE, *names}
    if staged:
        allowed.add(STAGE_MARKER)
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name not in allowed:
            kind = "directory" if entry.is_dir(follow_symlinks=False) else "file"
            why = (
                "not listed in shards.json"
                if P.SHARD_NAME_RE.match(entry.name)
                else ("a saev shard directory holds only metadata.json, shards.json, acts*.bin and labels.bin")
            )
            problems.append(f"stray {kind} {entry.name!r}: {why}")
        elif entry.name in (P.LABELS_FILE, P.OFFSETS_FILE) and isinstance(regular_size(root / entry.name), str):
            problems.append(f"{entry.name}: {regular_size(root / entry.name)} where a file belongs (readers refuse it)")
    if geom is None:
        for name in names:
            if not isinstance(regular_size(root / name), int):
                problems.append(f"{name}: missing (listed in shards.json)")
        return problems
    if geom.n_shards > len(names) + 1:  # shards.json's problem says so; do not list absurd counts
        return problems
    counts = geom.shard_counts()
    want = geom.shard_nbytes
    shape = (
        f"examples_per_shard {geom.examples_per_shard} x {geom.n_layers} layers x {geom.tokens_per_example} tokens "
        f"x {geom.d_model} d_model x 4 bytes"
    )
    sized = []
    for i, name in enumerate(names):
        p = root / name
        size = regular_size(p)
        if not isinstance(size, int):
            problems.append(
                f"{name}: {size} where a shard file belongs (readers refuse it)"
                if size
                else f"{name}: missing (listed in shards.json)"
            )
            continue
        if i >= len(counts) and size in (0, want):
            continue  # the trailing empty shard (schema.trailing_empty_shard): no data to check
        if size != want:
            problems.append(
                f"{name}: {size} bytes, expected {want} ({shape}; the last shard too is full size, zero-padded)"
            )
            continue
        sized.append((i, name))
        if i < len(counts) and counts[i] < geom.examples_per_shard:
            start = counts[i] * geom.example_nbytes
            if not _is_zero(p, start, want):
                problems.append(
                    f"{name}: padding after its {counts[i]} examples holds non-zero bytes (the last shard's padding must be zeros)"
                )
    labels = root / P.LABELS_FILE
    size = regular_size(labels)
    if isinstance(size, int):
        want_l = geom.n_examples * geom.content_tokens
        if size != want_l:
            problems.append(
                f"{P.LABELS_FILE}: {size} bytes, expected {want_l} (n_examples {geom.n_examples} x "
                f"{geom.content_tokens} content tokens, uint8)"
            )
    if values:
        problems += _check_values(root, sized, counts, geom, layers, progress)
        problems += checksums.check(root) or []  # a directory with actstore's sidecar: every byte as exported
    return problems


def _is_zero(path: Path, start: int, stop: int) -> bool:
    """True when bytes [start, stop) of a file are all zero; holes of a sparse file are skipped."""
    buf = np.empty(_BLOCK, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = start
        while pos < stop:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)  # holes read as zeros: skip them
            except OSError:  # ENXIO: no data after pos
                return True
            if pos >= stop:
                return True
            n = os.preadv(fd, [memoryview(buf)[: min(_BLOCK, stop - pos)]], pos)
            if n <= 0:
                return True
            if buf[:n].any():
                return False
            pos += n
        return True
    finally:
        os.close(fd)


def _check_values(
    root: Path, sized: list[tuple[int, str]], counts: list[int], geom: P.ShardGeometry, layers: list, progress: bool
) -> list[str]:
    from actstore.progress import bar as progress_bar  # a live bar on a terminal, lines in a pipe

    problems = []
    vec = geom.d_model * P.ITEMSIZE
    block = max(vec, _BLOCK // vec * vec)
    total = sum(counts[i] * geom.example_nbytes for i, _ in sized if i < len(counts))
    buf = np.empty(block // P.ITEMSIZE, dtype="<f4")
    with progress_bar(total=total, unit="B", unit_scale=True, desc="verify values", disable=not progress) as bar:
        for i, name in sized:
            if i >= len(counts):
                continue
            stop = counts[i] * geom.example_nbytes
            bad, first = 0, None
            with open(root / name, "rb", buffering=0) as f:
                pos = 0
                while pos < stop:
                    n = f.readinto(memoryview(buf).cast("B")[: min(block, stop - pos)])
                    if not n:
                        break
                    x = buf[: n // P.ITEMSIZE]
                    finite = np.isfinite(x)
                    if not finite.all():
                        nb = int(x.size - np.count_nonzero(finite))
                        if first is None:
                            first = pos // P.ITEMSIZE + int(np.argmin(finite))
                        bad += nb
                    pos += n
                    bar.update(n)
            if bad:
                L, T, D = geom.n_layers, geom.tokens_per_example, geom.d_model
                v = first // D
                ex, rest = divmod(v, L * T)
                lp, tok = divmod(rest, T)
                problems.append(
                    f"{name}: {bad} non-finite values (first at example {i * geom.examples_per_shard + ex}, "
                    f"layer {layers[lp]}, token {tok})"
                )
    return problems
