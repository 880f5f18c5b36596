"""Data sources: an image folder, a JSONL file, a saved HF `datasets` folder, or embedded data.

A source is a sequence of records in a fixed order (the store keeps that order):
image records {"key", "image": reference}, text records {"key", "text"}, or pair records
{"key", "prompt", "response" (None when the model is to generate it)}.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import DataError, EmptyDatasetError, UnreadableImageError
from actstore.inputs import embedded
from actstore.inputs.textdecode import Decoding

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
EMBEDDED_PREFIX = "embedded:"


@dataclass
class Source:
    """An ordered data source.

    Attributes:
        kind: "image", "text" or "pair".
        name: the --data value, recorded in the store's attrs["source"].
        n: number of records.
        get: record i (a dict; see the module docstring).
        given_response: (record index, where) of the first pair record that gives a
            response (`qa.jsonl:3`, or a dataset's column), so that --generate can refuse to
            replace it; None when no record gives one.
    """

    kind: str
    name: str
    n: int
    get: Callable[[int], dict[str, Any]]
    given_response: tuple[int, str] | None = None

    def __len__(self) -> int:
        return self.n

    def limit(self, max_examples: int | None) -> Source:
        if max_examples is None or max_examples >= self.n:
            return self
        if max_examples <= 0:
            raise DataError(f"--max-examples must be a positive int. Got {max_examples}.")
        given = self.given_response if self.given_response and self.given_response[0] < max_examples else None
        return Source(kind=self.kind, name=self.name, n=max_examples, get=self.get, given_response=given)


def load_source(spec: str, text_field: str | None = None, decoding: Decoding | None = None) -> Source:
    """Open a data source; raises EmptyDatasetError when it holds nothing. `text_field`
    names the column or JSON key holding each document's text (default "text");
    `decoding` how .txt files decode (default: strict UTF-8), checked here, before any model loads."""
    decoding = decoding or Decoding()
    if spec.startswith(EMBEDDED_PREFIX):
        src = _embedded(spec.removeprefix(EMBEDDED_PREFIX))
    elif any(c in spec for c in "*?["):
        src = _glob(spec, text_field, decoding)
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            raise DataError(f"--data {spec}: no such file or folder")
        _check_regular(p, spec)
        if p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
            src = _hf_datasets(p, text_field)
        elif p.is_dir():
            src = _image_folder(p)
        elif p.suffix == ".jsonl":
            src = _jsonl(p, text_field)
        elif p.suffix == ".txt":
            src = _txt_lines(p, decoding)
        elif p.suffix in (".parquet", ".arrow", ".feather"):
            src = _columnar(p, text_field or "text")
        else:
            raise DataError(
                f"--data {spec}: expected a folder of images, a .jsonl file of texts or prompt/response pairs, "
                "a .txt file (one document per line), a .parquet or .arrow file, a glob of .txt files (one document per file), "
                "a folder saved by datasets' save_to_disk, embedded:images or embedded:pydoc-topics"
            )
    if src.n == 0:
        raise EmptyDatasetError(f"--data {spec} holds no examples; nothing to capture")
    return src


def absolute_data(spec: str) -> str:
    """The --data value with a local path (or glob) made absolute, as the store records it and
    as writers elsewhere (Ray actors) must see it; embedded data stays as named."""
    if spec.startswith(EMBEDDED_PREFIX):
        return spec
    return os.path.abspath(os.path.expanduser(spec))


# ---- embedded ---------------------------------------------------------------------
def _embedded(which: str) -> Source:
    if which == "images":
        items = embedded.embedded_images()
        return Source(
            kind="image",
            name="embedded:images",
            n=len(items),
            get=lambda i: {"key": items[i][0], "image": {"embedded": items[i][0]}},
        )
    if which == "pydoc-topics":
        topics = embedded.pydoc_topics()
        return Source(
            kind="text",
            name="embedded:pydoc-topics",
            n=len(topics),
            get=lambda i: {"key": topics[i][0], "text": topics[i][1]},
        )
    raise DataError(f"no embedded data {which!r}; there are {[EMBEDDED_PREFIX + d for d in embedded.EMBEDDED_DATA]}")


# ---- image folders ----------------------------------------------------------------
def _image_folder(root: Path) -> Source:
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )
    if not files:
        if any(p.suffix.lower() == ".txt" for p in root.iterdir()):
            raise EmptyDatasetError(
                f"--data {root}: {root} holds .txt files, not images: pass a glob such as '{root}/*.txt' "
                "(quoted: a document a file)"
            )
        raise EmptyDatasetError(
            f"--data {root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this folder; nothing to capture"
        )
    _check_headers(files)
    root_abs = root.resolve()

    def get(i: int) -> dict[str, Any]:
        f = files[i].resolve()
        return {"key": _key(str(f.relative_to(root_abs))), "image": {"path": str(f)}}

    return Source(kind="image", name=str(root), n=len(files), get=get)


def _check_headers(files: Sequence[Path]) -> None:
    """Open every image's header (cheap) so a non-image fails before anything is written."""
    from PIL import Image

    for f in files:
        try:
            with Image.open(f) as im:
                im.size  # noqa: B018 - reading the header is the check
        except Exception as e:  # noqa: BLE001 - PIL raises many types
            raise UnreadableImageError(f"cannot read image {f}: {e}; remove or replace the file") from None


def load_image(ref: dict[str, Any]) -> np.ndarray:
    """(H, W, 3) uint8 RGB pixels of an image reference ({"path"} or {"embedded"})."""
    if "embedded" in ref:
        return embedded.load_embedded_image(ref["embedded"])
    if "dataset" in ref:
        ds = _open_dataset(ref["dataset"])
        return np.asarray(ds[int(ref["row"])][ref["column"]].convert("RGB"))
    from PIL import Image

    path = ref["path"]
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except FileNotFoundError:
        raise UnreadableImageError(f"image {path} no longer exists") from None
    except Exception as e:  # noqa: BLE001
        raise UnreadableImageError(f"cannot read image {path}: {e}; remove or replace the file") from None


_DATASETS: dict[str, Any] = {}


def _open_dataset(path: str) -> Any:
    """A saved datasets folder (one split), opened once per process."""
    ds = _DATASETS.get(path)
    if ds is None:
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path} is a saved HF datasets folder; reading it needs `pip install datasets`") from None
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
            if split is None:
                raise DataError(f"{path} holds splits {list(ds)}; save one split (or a 'train' split) to capture")
            ds = ds[split]
        _DATASETS[path] = ds
    return ds


def _key(s: str) -> str:
    """A sample key of at most 64 UTF-8 bytes (long names keep their tail and a hash)."""
    if len(s.encode()) <= 64:
        return s
    import hashlib

    h = hashlib.sha1(s.encode()).hexdigest()[:16]
    tail = s.encode()[-40:].decode("utf-8", "ignore")
    return f"{h}-{tail}"


# ---- JSONL ------------------------------------------------------------------------
def _check_regular(p: Path, spec: str) -> None:
    """A data file must be a regular file (a FIFO would block the capture) or a folder."""
    import stat

    from actstore.storage.regular import describe

    mode = p.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise DataError(f"--data {spec}: {p} is {describe(mode)}, not a file or folder of data")


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read document {path}: {e}") from None


def _txt_lines(path: Path, decoding: Decoding) -> Source:
    """One document a non-empty line, streamed (only each line's byte range is kept)."""
    lines = _LineIndex(path)
    keep = np.asarray([decoding.check(raw, f"{path}:{lineno}") for lineno, raw in lines.scan()], bool)
    kept = np.flatnonzero(keep) if len(keep) else np.zeros(0, np.int64)
    return Source(
        kind="text",
        name=str(path),
        n=len(kept),
        get=lambda i: {
            "key": f"line-{int(lines.linenos[kept[i]])}",
            "text": decoding.decode(lines.read(int(kept[i]))).rstrip("\r\n"),
        },
    )


def _glob(spec: str, text_field: str | None, decoding: Decoding) -> Source:
    """Files matching a glob, in sorted order: .txt files are one document each; other
    files' sources (.jsonl, .parquet, ...) are concatenated (all of one kind)."""
    import glob

    files = sorted(glob.glob(spec, recursive=True))
    if not files:
        raise EmptyDatasetError(f"--data {spec}: no file matches this pattern")
    for f in files:
        _check_regular(Path(f), spec)
    if all(f.endswith(".txt") for f in files):
        files = [
            f for f in files if decoding.check(_read_bytes(f), f)
        ]  # every file decodes (or is left out) before a model loads

        def get_file(i: int) -> dict[str, Any]:
            try:
                return {"key": _key(files[i]), "text": decoding.decode(Path(files[i]).read_bytes())}
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"cannot read document {files[i]}: {e}") from None

        return Source(kind="text", name=spec, n=len(files), get=get_file)
    parts = [load_source(f, text_field, decoding) for f in files]
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        raise DataError(f"--data {spec} matches files of different kinds ({sorted(kinds)}); use one kind per run")
    offsets = np.cumsum([0] + [p.n for p in parts])

    def get(i: int) -> dict[str, Any]:
        k = int(np.searchsorted(offsets, i, side="right")) - 1
        rec = dict(parts[k].get(i - int(offsets[k])))
        rec["key"] = _key(f"{k}:{rec['key']}")
        return rec

    given = next(
        ((int(o) + p.given_response[0], p.given_response[1]) for o, p in zip(offsets, parts) if p.given_response), None
    )
    return Source(kind=kinds.pop(), name=spec, n=int(offsets[-1]), get=get, given_response=given)


def _columnar(path: Path, text_field: str) -> Source:
    """A parquet file (read a row group at a time) or an Arrow IPC file or stream (as
    `datasets` writes them; memory-mapped, so pages are read as the records are used); only
    the text column is read."""
    import pyarrow as pa

    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            counts = [pf.metadata.row_group(k).num_rows for k in range(pf.metadata.num_row_groups)]
            read_part = lambda k: pf.read_row_group(k, columns=[text_field]).column(0)  # noqa: E731
        else:
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(path)))
                schema = reader.schema
                counts = [reader.get_batch(k).num_rows for k in range(reader.num_record_batches)]
                read_part = lambda k: reader.get_batch(k).column(text_field)  # noqa: E731
            except pa.ArrowInvalid:
                with pa.ipc.open_stream(pa.memory_map(str(path))) as r:
                    table = r.read_all()  # zero-copy views of the mapped file: nothing is loaded
                schema, counts = table.schema, [table.num_rows]
                read_part = lambda k: table.column(text_field)  # noqa: E731
        names = schema.names
        kind = schema.field(text_field).type if text_field in names else None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if kind is None:
        raise DataError(f"{path} has no column {text_field!r} (columns: {names[:20]}); pass --text-field NAME")
    if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
        raise DataError(f"{path}: column {text_field!r} holds {kind}, not text; pass --text-field NAME")
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    cache: dict[int, Any] = {}

    def get(i: int) -> dict[str, Any]:
        k = int(np.searchsorted(starts, i, side="right")) - 1
        if k not in cache:
            cache.clear()  # one row group (or record batch) in memory at a time
            cache[k] = read_part(k)
        return {"key": f"row-{i}", "text": cache[k][i - int(starts[k])].as_py() or ""}

    return Source(kind="text", name=str(path), n=int(starts[-1]), get=get)


def _jsonl(path: Path, text_field: str | None = None) -> Source:
    """One record a non-empty line. Streamed: a first pass checks every line (a bad one is
    named) and keeps only each record's byte range; records are read back one by one."""
    lines = _LineIndex(path)
    kinds = set()
    given = None

    def record(obj: Any, where: str, i: int) -> tuple[dict[str, Any], str]:
        if text_field is not None:
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise DataError(
                    f"{where}: no string field {text_field!r} (--text-field); this line has {sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__}"
                )
            obj = {"id": obj.get("id", f"line-{i}"), "text": obj[text_field]}
        return _record(obj, where, i)

    for i, (lineno, raw) in enumerate(lines.scan()):
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
        rec, kind = record(obj, f"{path}:{lineno}", i)
        kinds.add(kind)
        if given is None and rec.get("response") is not None:
            given = (i, f"{path}:{lineno}")
    if len(kinds) > 1:
        raise DataError(f"{path} mixes plain texts and prompt/response pairs; use one kind per file")

    def get(i: int) -> dict[str, Any]:
        try:
            return record(json.loads(lines.read(i)), f"{path} record {i}", i)[0]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path} changed while being read (record {i}: {e}); rerun with --resume") from None

    return Source(kind=kinds.pop() if kinds else "text", name=str(path), n=len(lines), get=get, given_response=given)


class _LineIndex:
    """The byte ranges of a text file's non-empty lines, read back with pread (thread-safe)."""

    def __init__(self, path: Path):
        self.path = path
        self.starts = np.zeros(0, np.int64)
        self.ends = np.zeros(0, np.int64)
        self.linenos = np.zeros(0, np.int64)
        self._fd: int | None = None

    def scan(self) -> Any:
        """Yield (line number, bytes) of every non-empty line, recording their ranges."""
        starts, ends, linenos = [], [], []
        pos = 0
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                end = pos + len(raw)
                if raw.strip():
                    starts.append(pos)
                    ends.append(end)
                    linenos.append(lineno)
                    yield lineno, raw
                pos = end
        self.starts, self.ends, self.linenos = (np.asarray(v, np.int64) for v in (starts, ends, linenos))

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, i: int) -> bytes:
        import weakref

        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        return os.pread(self._fd, int(self.ends[i] - self.starts[i]), int(self.starts[i]))


def _record(obj: Any, where: str, i: int) -> tuple[dict[str, Any], str]:
    if isinstance(obj, str):
        return {"key": f"line-{i}", "text": obj}, "text"
    if not isinstance(obj, dict):
        raise DataError(
            f'{where}: expected a JSON string or an object with "text" or "prompt" (and "response"); got {type(obj).__name__}'
        )
    key = _key(str(obj.get("id", f"line-{i}")))
    if "prompt" in obj:
        resp = obj.get("response")
        if not isinstance(obj["prompt"], str) or not (resp is None or isinstance(resp, str)):
            raise DataError(f'{where}: "prompt" and "response" must be strings')
        return {"key": key, "prompt": obj["prompt"], "response": resp}, "pair"
    if isinstance(obj.get("text"), str):
        return {"key": key, "text": obj["text"]}, "text"
    raise DataError(f'{where}: the object has no "text" or "prompt" string (keys: {sorted(obj)[:10]})')


# ---- HF datasets ------------------------------------------------------------------
def _hf_datasets(path: Path, text_field: str | None = None) -> Source:
    """A `save_to_disk` folder (memory-mapped Arrow: rows are read one by one, only the
    columns a record needs). Texts come from `text_field` (default `text`)."""
    ds = _open_dataset(str(path.resolve()))
    cols = set(ds.column_names)
    keys = ["id"] if "id" in cols else []
    if text_field is not None:
        if text_field not in cols:
            raise DataError(f"{path} has no column {text_field!r} (--text-field); its columns: {sorted(cols)[:20]}")
        kind = getattr(ds.features[text_field], "dtype", None)
        if kind not in ("string", "large_string"):
            raise DataError(
                f"{path}: column {text_field!r} holds {ds.features[text_field]}, not text; pass --text-field NAME"
            )
        text = ds.select_columns([text_field, *keys])
        return Source(kind="text", name=str(path), n=len(ds), get=lambda i: _text_row(text, i, text_field, path))
    if "image" in cols or "img" in cols:
        col = "image" if "image" in cols else "img"

        def get_img(i: int) -> dict[str, Any]:
            return {"key": _row_key(ds, i), "image": {"dataset": str(path.resolve()), "column": col, "row": i}}

        return Source(kind="image", name=str(path), n=len(ds), get=get_img)
    if "prompt" in cols:
        pairs = ds.select_columns(["prompt", *(["response"] if "response" in cols else []), *keys])
        return Source(
            kind="pair",
            name=str(path),
            n=len(ds),
            get=lambda i: (
                lambda r: {"key": _row_key(pairs, i, r), "prompt": r["prompt"], "response": r.get("response")}
            )(pairs[i]),
            given_response=_first_response(ds, path) if "response" in cols else None,
        )
    if "text" in cols:
        text = ds.select_columns(["text", *keys])
        return Source(kind="text", name=str(path), n=len(ds), get=lambda i: _text_row(text, i, "text", path))
    raise DataError(
        f"{path}: a datasets folder needs an 'image', 'text' or 'prompt' column (or --text-field NAME); it has {sorted(cols)}"
    )


def _first_response(ds: Any, path: Path) -> tuple[int, str] | None:
    """(row, where) of the first row whose 'response' is not null (one column read)."""
    valid = np.flatnonzero(np.asarray(ds.data.column("response").is_valid()))
    return (int(valid[0]), f"{path} row {int(valid[0])} (column 'response')") if valid.size else None


def _text_row(ds: Any, i: int, field: str, path: Path) -> dict[str, Any]:
    row = ds[i]
    value = row[field]
    if not isinstance(value, str):
        raise DataError(
            f"{path} row {i}: column {field!r} holds {type(value).__name__}, not text; pass --text-field NAME"
        )
    return {"key": _row_key(ds, i, row), "text": value}


def _row_key(ds: Any, i: int, row: dict[str, Any] | None = None) -> str:
    if "id" not in ds.column_names:
        return f"row-{i}"
    return _key(str((row if row is not None else ds[i])["id"]))
