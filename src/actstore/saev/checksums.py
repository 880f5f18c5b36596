"""The checksum sidecar of a saev export: `actstore_checksums.json` beside the acts files.

saev's protocol has no checksums, so a zeroed or changed range inside an acts file passes
every size rule. export-saev records each file it writes (acts*.bin, whole and padded,
labels.bin, example_offsets.bin) with its size and crc32c:

    {"algorithm": "crc32c", "files": {"acts000000.bin": {"bytes": 123, "crc32c": 456}, ...}}

`verify-saev --values` and `import-saev` check the files against it when it is present
(directories from saev itself or older exports have none). saev's own loaders read only
the files they name, so the extra file does not disturb them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import SaevFormatError
from actstore.layout import saevspec as P
from actstore.layout.checksum import crc32c, extend_zeros
from actstore.read.saevschema import read_json, regular_size

ALGORITHM = "crc32c"
_BLOCK = 16 * 2**20  # bytes per read


class FileCrc:
    """The running crc32c of a file written in order (bytes then zero padding)."""

    def __init__(self) -> None:
        self.crc, self.nbytes = 0, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.crc = crc32c(view, self.crc)
        self.nbytes += view.nbytes

    def pad_to(self, size: int) -> None:
        """As if zeros filled the file up to `size` bytes (a sparse hole reads as zeros),
        computed, not read: O(log size)."""
        if size > self.nbytes:
            self.crc = extend_zeros(self.crc, size - self.nbytes)
            self.nbytes = size

    def record(self) -> dict[str, int]:
        return {"bytes": self.nbytes, "crc32c": self.crc}


def file_crc(path: Path) -> dict[str, int]:
    """`{"bytes", "crc32c"}` of a file read from disk."""
    c = FileCrc()
    buf = np.empty(_BLOCK, np.uint8)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(memoryview(buf)):
            c.update(memoryview(buf)[:n])
    return c.record()


def sidecar_bytes(files: dict[str, dict[str, int]]) -> bytes:
    return (json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1) + "\n").encode()


def check(root: str | os.PathLike, *, progress: Any = None) -> list[str] | None:
    """Every file the sidecar records compared with the disk (size, crc32c); None when
    the directory has no sidecar. `progress(n)` is called with bytes read."""
    root = Path(root)
    side = root / P.CHECKSUMS_FILE
    if regular_size(side) is None:
        return None
    doc, problem = read_json(side)  # a regular file within the JSON limits (a FIFO there would block)
    files = doc.get("files") if isinstance(doc, dict) else None
    if problem is None and (
        not isinstance(doc, dict)
        or doc.get("algorithm") != ALGORITHM
        or not isinstance(files, dict)
        or not all(isinstance(w, dict) for w in files.values())
    ):
        problem = f"{P.CHECKSUMS_FILE}: not an actstore checksum sidecar (algorithm {ALGORITHM!r}, files by name)"
    if problem is not None:
        return [f"{problem}; export again, or delete {P.CHECKSUMS_FILE} to skip the checksums"]
    problems = []
    for name, want in files.items():
        size = regular_size(root / name) if isinstance(name, str) and "/" not in name else None
        if not isinstance(size, int):
            what = f"{size} where a file belongs" if size else f"missing ({P.CHECKSUMS_FILE} records it)"
            problems.append(f"{name}: {what}")
            continue
        got = file_crc(root / name)
        if progress is not None:
            progress(got["bytes"])
        if got["bytes"] != want.get("bytes"):
            problems.append(f"{name}: {got['bytes']} bytes, the export wrote {want.get('bytes')} ({P.CHECKSUMS_FILE})")
        elif got["crc32c"] != want.get("crc32c"):
            problems.append(
                f"{name}: crc32c {got['crc32c']} differs from the export's {want.get('crc32c')}: its bytes changed "
                "after the export (copy it again, or export again)"
            )
    return problems


def require(root: str | os.PathLike) -> None:
    """Raise SaevFormatError listing every file that differs from the sidecar (if any)."""
    problems = check(root)
    if problems:
        raise SaevFormatError(f"{root} does not match its checksums ({P.CHECKSUMS_FILE}): " + "; ".join(problems))
