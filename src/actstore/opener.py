"""`actstore.open`: one entry point for both kinds of stores a reader may be pointed at.

An actstore store (manifest.json) opens as an ActStore; a saev 2.0/2.1 shard directory
(metadata.json and shards.json, no manifest.json) as a SaevStore over np.memmap. Both
have the same reading API (`len`, `layers`, `store[ex, layer]`, `read_into`, ...).
Both are Readers (actstore.read.interface), opened by actstore.read.api.as_reader; this
module adds the verification of saev directories, which lives in actstore.saev.
"""

from __future__ import annotations

import os

from actstore.errors import VerificationError
from actstore.read.api import Reader, as_reader
from actstore.read.saevstore import is_saev_dir
from actstore.read.store import VERIFY_MODES


def open(path: str | os.PathLike, *, verify: str | None = None) -> Reader:
    """Open the store at `path` for reading, whichever kind it is.

    Args:
        path: an actstore store root, or a saev shard directory (`<HASH>`).
        verify: None (the default: only what opening checks), "fast" (every file present at
            its size; for saev every rule of `actstore verify-saev`) or "deep" (also every
            byte: chunk crc32c values for an actstore store, every activation finite for a
            saev directory). Damage raises VerificationError holding the report. "reads" (an
            actstore store): every activation read is checked against its writer's crc32c
            as it is read (CorruptChunkError), docs/format.md section 3.4.

    Returns:
        An ActStore, or a SaevStore for a saev directory.
    """
    if verify is False:
        verify = None
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {list(VERIFY_MODES)}. Got {verify!r}.")
    if is_saev_dir(path):
        if verify == "reads":
            raise ValueError(
                "verify='reads' checks an actstore store's reads; verify a saev directory with 'fast' or 'deep'"
            )
        if verify is not None:
            _verify_saev(path, deep=verify == "deep")
        return as_reader(path)
    return as_reader(path, verify=verify)


def _verify_saev(path: str | os.PathLike, *, deep: bool) -> None:
    """verify_saev, raised as VerificationError like ActStore's verify= (saev's own only reports)."""
    from actstore.saev.verify import verify_saev

    report = verify_saev(path, values=deep)
    if not report.ok:
        n = len(report.problems)
        raise VerificationError(
            f"{path} failed verification ({'deep' if deep else 'fast'}): {n} problem{'s' if n != 1 else ''}, the first: "
            f"{report.problems[0]}. Run `actstore verify-saev {path}{' --values' if deep else ''}` for the full list",
            report,
        )
