"""An export-saelens folder checked against what its export recorded: `verify_saelens_folder`.

export-saelens writes into `saelens_config.json` the row count (`n_rows`) and, per Arrow
data file, its size and sha256 (`files`). `datasets.load_from_disk` checks none of that:
a data file cut at a record-batch boundary loads short with no error. This check reads
every data file's rows (Arrow stream headers) and bytes (sha256) and compares them with
the record, with the file list of `state.json`, and with the files in the folder. A folder
exported before the record existed is checked for rows and files only, and says so.
`actstore verify OUT` and importers call it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.errors import SaelensFolderError

CONFIG = "saelens_config.json"
STATE = "state.json"
HASH_BLOCK = 16 * 2**20  # bytes read at a time for a checksum


@dataclass
class SaelensCheck:
    """What `verify_saelens_folder` found: `problems` is empty when the folder is sound."""

    path: Path
    n_rows: int = 0
    n_files: int = 0
    n_bytes: int = 0
    checksums: bool = False  # whether the export recorded checksums (and they were compared)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (
            f"verify (saelens export) {self.path}: {self.n_rows} rows in {self.n_files} data files, "
            f"{self.n_bytes} bytes read"
        )
        if not self.checksums:
            head += " (no checksums recorded: exported before actstore recorded them; rows and files checked)"
        return head + (": OK" if self.ok else f": {len(self.problems)} problem{'s' if len(self.problems) > 1 else ''}")

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": "saelens-export",
            "ok": self.ok,
            "n_rows": self.n_rows,
            "n_files": self.n_files,
            "n_bytes": self.n_bytes,
            "checksums": self.checksums,
            "problems": list(self.problems),
        }


def is_saelens_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a local folder holding an export-saelens config."""
    return (Path(path) / CONFIG).is_file()


def file_record(path: Path) -> dict[str, Any]:
    """`{"name", "bytes", "sha256"}` of a data file, as the export records it."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
            n += len(block)
    return {"name": path.name, "bytes": n, "sha256": h.hexdigest()}


def _rows(path: Path) -> int:
    """Rows in an Arrow stream file (its batches' headers; the data is mapped, not read)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_stream(src)
        return sum(b.num_rows for b in reader)


def verify_saelens_folder(path: str | os.PathLike, *, raise_on_error: bool = True) -> SaelensCheck:
    """Check an export-saelens folder: its config, the data files `state.json` lists and the
    config records (names, sizes, sha256), their rows against `n_rows`, and no stray data file.

    Args:
        path: the folder export-saelens wrote (OUT).
        raise_on_error: raise SaelensFolderError listing every problem (else: in the report).

    Returns:
        The report (`problems` empty when sound).
    """
    root = Path(path)
    rep = SaelensCheck(path=root)
    try:
        config = json.loads((root / CONFIG).read_text(encoding="utf-8"))
        state = json.loads((root / STATE).read_text(encoding="utf-8"))
        listed = [d["filename"] for d in state["_data_files"]]
        n_rows = config["n_rows"]
        records = config.get("files")
        if not isinstance(n_rows, int) or (records is not None and not isinstance(records, list)):
            raise TypeError("n_rows must be an int and files a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        rep.problems.append(
            f"{root} is not a readable export-saelens folder ({CONFIG} and {STATE} with n_rows and "
            f"_data_files): {type(e).__name__}: {e}; export it again"
        )
        return _done(rep, raise_on_error)
    rep.checksums = records is not None
    recorded = {r.get("name"): r for r in records or [] if isinstance(r, dict)}
    if records is not None and sorted(recorded) != sorted(listed):
        rep.problems.append(f"{STATE} lists {sorted(listed)} but {CONFIG} records {sorted(recorded)}")
    stray = sorted(p.name for p in root.glob("*.arrow") if p.name not in listed)
    if stray:
        rep.problems.append(f"data files not in {STATE}: {stray} (datasets would not read them)")
    for name in listed:
        f = root / name
        if not f.is_file():
            rep.problems.append(f"{f} is missing ({STATE} lists it)")
            continue
        rep.n_files += 1
        try:
            rep.n_rows += _rows(f)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            rep.problems.append(f"{f} is not a whole Arrow stream ({e}); it was cut or damaged: export again")
        want = recorded.get(name)
        if want is not None:
            got = file_record(f)
            rep.n_bytes += got["bytes"]
            if got["bytes"] != want.get("bytes"):
                rep.problems.append(
                    f"{f} has {got['bytes']} bytes; the export wrote {want.get('bytes')}: truncated or "
                    "overwritten (copy it again from the source, or export again)"
                )
            elif got["sha256"] != want.get("sha256"):
                rep.problems.append(
                    f"{f}: sha256 {got['sha256']} differs from the export's {want.get('sha256')}: "
                    "its bytes changed (copy it again from the source, or export again)"
                )
    if rep.n_rows != n_rows:
        rep.problems.append(
            f"the data files hold {rep.n_rows} rows; the export wrote {n_rows} ({CONFIG} n_rows): "
            "a file was cut or replaced; datasets would load it short with no error"
        )
    return _done(rep, raise_on_error)


def _done(rep: SaelensCheck, raise_on_error: bool) -> SaelensCheck:
    if raise_on_error and rep.problems:
        raise SaelensFolderError(f"{rep.path} does not match its export: " + "; ".join(rep.problems))
    return rep
