"""export_saelens: one layer of a store as the cached-activations dataset SAELens trains from.

SAELens (sae-lens 6.x, `use_cached_activations=True`) reads a `datasets.save_to_disk`
directory: Arrow stream files `data-NNNNN-of-NNNNN.arrow`, `state.json` and
`dataset_info.json`, with a column named by the hook (`Array2D((C, d_in))`) and
`token_ids` (int32, length C). It reads rows in order and mixes only about
`n_batches_in_buffer` rows, so the export shuffles at token level (TokenStream's seeded
windows, bounded memory) and packs real tokens only (never padding) into rows of C. The
last row is filled up with token id -1 and zero vectors, as are the rows added to make the
row count a multiple of `store_batch_size_prompts` (SAELens never reads the remainder).
Token ids are the store's (`ActStore.token_ids`) where it keeps them; otherwise -2 for a
content token, -3 a special token, -4 a chat-template token (from the token labels).
Built with pyarrow from flat numpy buffers; published by swapping in a finished stage
(actstore.storage.swap), so a killed export leaves nothing that looks complete and never a
folder lost: one that is not an export is kept aside. saelens_config.json
records the row count and each data file's size and sha256, which `actstore verify OUT`
(`verify_saelens_folder`) checks.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import SaelensExportError
from actstore.index import layer_position
from actstore.read import masks
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.read.family import FamilyStore
from actstore.read.state import check_unchanged
from actstore.saelens.card import dataset_card
from actstore.saelens.check import CONFIG, file_record
from actstore.storage.durable import SYNC_FILE_RANGE_WRITE, sync_file_range
from actstore.storage.files import export_os_errors

DEFAULT_CONTEXT = 128
NO_TOKEN, CONTENT, SPECIAL, TEMPLATE = -1, -2, -3, -4  # token_ids codes when the store keeps no ids
FILE_BYTES = 512 * 2**20  # an Arrow file's activation bytes (SAELens caches use 0.5-2 GB)
BATCH_BYTES = 16 * 2**20  # a record batch (and a stream batch): the stream keeps 6 such buffers
TRAIN_BATCH_TOKENS = 4096  # SAELens's default train_batch_size_tokens


@dataclass(frozen=True)
class SaelensExport:
    path: Path
    hook_name: str
    context_size: int
    d_in: int
    n_rows: int
    n_tokens: int
    config: dict[str, Any]


def export_saelens(
    store: ReaderLike,
    out: str | os.PathLike,
    *,
    layer: Any,
    hook_name: str | None = None,
    context_size: int = DEFAULT_CONTEXT,
    seed: int = 0,
    dtype: str = "float32",
    skip_special: bool | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> SaelensExport:
    """Write layer `layer` of `store` (an ActStore, a path or a URL) to `out` for SAELens.

    Args:
        layer: a stored layer number or name (`blocks.8.hook_resid_post`, a module path).
        hook_name: the column name, which SAELens's `hook_name` must equal (default: the
            name the capture kept for the layer: its TransformerLens name, or its module path
            for a module-path capture; else `blocks.{layer}.hook_resid_post`).
        context_size: tokens per row (SAELens's `context_size`).
        seed: the token-level shuffle's seed.
        dtype: "float32" (exact for every store dtype) or "float16" (exact for float16 stores).
        skip_special: leave out tokens labelled special or chat template (BOS: every
            --pack/--chunk window starts with one). Default (None): as the loaders'
            default mask (actstore.read.masks), True for a text store whose labels mark
            token kinds, False otherwise; False keeps every token.
        overwrite: replace an earlier export in `out` (swapped in whole once the new one is
            complete); without it, a folder that is not empty is refused.

    Raises:
        DiskFullError / ExportWriteError naming the file and the fix when a write fails
        (nothing is published then).
    """
    store = as_reader(store)
    if isinstance(store, FamilyStore):  # a family: the member holding the site
        store, (layer,) = store.one_member(layer, "export one site a run")
    with export_os_errors(
        f"exporting {store.path} for SAELens", Path(os.path.abspath(out)), "the same export-saelens command"
    ):
        return _export(
            store,
            out,
            layer=layer,
            hook_name=hook_name,
            context_size=context_size,
            seed=seed,
            dtype=dtype,
            skip_special=skip_special,
            overwrite=overwrite,
            progress=progress,
        )


def _export(
    store: Reader,
    out: str | os.PathLike,
    *,
    layer: Any,
    hook_name: str | None,
    context_size: int,
    seed: int,
    dtype: str,
    skip_special: bool | None,
    overwrite: bool,
    progress: bool,
) -> SaelensExport:
    from actstore.loaders import TokenStream
    from actstore.saev.publish import publish, remove_stale, temp_dir

    number = store.layer_number(layer)
    layer_position(store.layers, number)  # raises LayerNotFoundError listing the stored layers
    hook = hook_name or _default_hook(store, number)
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise SaelensExportError(f"context_size must be a positive int. Got {context_size!r}.")
    if dtype not in ("float32", "float16"):
        raise SaelensExportError(f"dtype must be 'float32' or 'float16' (Arrow has no bfloat16). Got {dtype!r}.")
    if dtype == "float16" and store.dtype != "float16":
        raise SaelensExportError(f"dtype float16 would round this {store.dtype} store; export float32")
    if skip_special is None:
        skip_special = masks.leaves_out_special(store)
    if skip_special and not store.config.token_labels:
        raise SaelensExportError("skip_special needs per-token labels; this store has none")
    if progress:
        from actstore.progress import say

        say(f"export-saelens {hook}: {masks.summarize(store).line(keep_all=not skip_special)}")
    out = Path(os.path.abspath(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (overwrite and out.is_dir()):
        raise SaelensExportError(
            f"{out} exists and is not empty; export to a new folder, or replace it with overwrite=True (--overwrite)"
        )
    C, D = context_size, store.d_model
    ids_of = _token_id_table(store)
    import torch

    np_dtype = np.dtype(dtype)
    # The stream's threads convert to the column dtype; its batches are whole rows but the last.
    ts = TokenStream(
        store,
        batch_size=max(C, BATCH_BYTES // (D * 4) // C * C),
        layers=[number],
        seed=seed,
        shuffle=True,
        return_index=True,
        token_mask=masks.CONTENT if skip_special else masks.ALL,
        threads=2,
        dtype=torch.float32 if dtype == "float32" else torch.float16,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent, out.name, marker=CONFIG)  # what a killed export left: settled
    tmp = temp_dir(out.parent, out.name)
    try:
        writer = _ArrowFiles(tmp, hook, C, D, np_dtype)
        carry_x, carry_id = np.zeros((0, D), np_dtype), np.zeros(0, np.int32)
        from actstore.progress import bar

        with bar(total=len(ts), unit="batch", desc=f"export-saelens {hook}", disable=not progress) as pbar:
            for b in ts:
                x = b["acts"].numpy()
                ids = ids_of(b["example"].numpy(), b["segment"].numpy(), b["token"].numpy())
                if len(carry_x):  # (only before a short last batch: the others are whole rows)
                    x, ids = np.concatenate([carry_x, x]), np.concatenate([carry_id, ids])
                full = len(x) // C * C
                if full:
                    writer.write(x[:full].reshape(-1, C, D), ids[:full].reshape(-1, C))
                carry_x, carry_id = x[full:].copy(), ids[full:].copy()  # copy: the stream may reuse its buffer
                pbar.update(1)
        n_tokens = writer.tokens + len(carry_x)
        if n_tokens == 0:
            raise SaelensExportError(f"layer {number} of {store.path} holds no tokens to export")
        rows = writer.rows + (1 if len(carry_x) else 0)
        prompts = min(32, rows)
        pad_rows = -rows % prompts
        if len(carry_x) or pad_rows:
            last_x = np.zeros((1 + pad_rows if len(carry_x) else pad_rows, C, D), np_dtype)
            last_id = np.full(last_x.shape[:2], NO_TOKEN, np.int32)
            if len(carry_x):
                last_x[0, : len(carry_x)] = carry_x
                last_id[0, : len(carry_id)] = carry_id
            writer.write(last_x, last_id)
        files = writer.close()
        records = [
            file_record(tmp / f) for f in files
        ]  # read back (from the page cache): what `actstore verify OUT` checks
        config = _config(store, hook, C, D, out, writer.rows, prompts, ids_of.codes, records)
        _write_json(
            tmp / "state.json",
            {
                "_data_files": [{"filename": f} for f in files],
                "_fingerprint": uuid.uuid4().hex[:16],
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            },
        )
        _write_json(
            tmp / "dataset_info.json",
            {
                "citation": "",
                "description": f"actstore export of {store.path}, layer {number}",
                "features": writer.features.to_dict(),
                "homepage": "",
                "license": "",
            },
        )
        _write_json(tmp / CONFIG, config)
        (tmp / "README.md").write_text(
            dataset_card(
                store=store,
                layer=number,
                hook=hook,
                context_size=C,
                d_in=D,
                n_rows=writer.rows,
                n_tokens=n_tokens,
                dtype=dtype,
                seed=seed,
                skip_special=skip_special,
                config=config,
            ),
            encoding="utf-8",
        )
        check_unchanged(store, "export-saelens")  # the rows are of the state the export began with
        if out.exists() and not any(out.iterdir()):
            out.rmdir()  # empty (checked above)
        if not publish(tmp, out, replace=overwrite, marker=CONFIG):  # an earlier export is swapped out whole
            raise SaelensExportError(f"{out} appeared while exporting; export to a new folder or pass --overwrite")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SaelensExport(
        path=out, hook_name=hook, context_size=C, d_in=D, n_rows=writer.rows, n_tokens=n_tokens, config=config
    )


def _default_hook(store: Reader, number: int) -> str:
    """The name the capture gave the layer (a TransformerLens name, or the module path of a
    module-path capture: what SAELens's HF wrapper hooks), else the block output's name."""
    names = store.config.attrs.get("hook_names")
    name = names.get(str(number)) if isinstance(names, dict) else None
    return name if isinstance(name, str) and name else f"blocks.{number}.hook_resid_post"


class _TokenIds:
    """(example, segment index, token) -> the token id SAELens sees (vectorised)."""

    def __init__(self, store: Reader):
        self.segments = list(store.segments)
        self.real = bool(store.config.token_ids)
        labels = store.config.token_labels
        name = "token_ids" if self.real else ("token_labels" if labels else None)
        self.tables = [np.asarray(store.field(f"{s}_{name}")) for s in self.segments] if name else None
        self.codes = [NO_TOKEN] if self.real else [NO_TOKEN, SPECIAL, TEMPLATE] if labels else [NO_TOKEN]

    def __call__(self, ex: np.ndarray, seg: np.ndarray, tok: np.ndarray) -> np.ndarray:
        out = np.full(len(ex), CONTENT, np.int32)
        if self.tables is None:
            return out
        for k, table in enumerate(self.tables):
            m = seg == k
            if m.any():
                v = table[ex[m], tok[m]]
                out[m] = v if self.real else np.select([v == 1, v == 2], [SPECIAL, TEMPLATE], CONTENT)
        return out


def _token_id_table(store: Reader) -> _TokenIds:
    return _TokenIds(store)


class _ArrowFiles:
    """Rows (C, D) and token ids (C,) into Arrow stream files of about FILE_BYTES each."""

    def __init__(self, root: Path, hook: str, C: int, D: int, dtype: np.dtype):
        import datasets
        import pyarrow as pa

        self.pa, self.root, self.C, self.D, self.dtype = pa, root, C, D, dtype
        self.features = datasets.Features(
            {
                hook: datasets.Array2D((C, D), dtype.name),
                "token_ids": datasets.Sequence(datasets.Value("int32"), length=C),
            }
        )
        self.schema = self.features.arrow_schema
        self.ext_type = self.schema.field(hook).type
        self.rows = self.tokens = 0
        self.files: list[str] = []
        self._sink = self._writer = None
        self._file_rows = 0
        self._rows_per_file = max(1, FILE_BYTES // (C * D * dtype.itemsize))
        self._rows_per_batch = max(1, BATCH_BYTES // (C * D * dtype.itemsize))

    def write(self, x: np.ndarray, ids: np.ndarray) -> None:
        for s in range(0, len(x), self._rows_per_batch):
            self._batch(x[s : s + self._rows_per_batch], ids[s : s + self._rows_per_batch])

    def _batch(self, x: np.ndarray, ids: np.ndarray) -> None:
        pa, C, D = self.pa, self.C, self.D
        if self._writer is None or self._file_rows >= self._rows_per_file:
            self._roll()
        r = len(x)
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(0, (r * C + 1) * D, D, dtype=np.int32)), pa.array(np.ascontiguousarray(x).reshape(-1))
        )
        outer = pa.ListArray.from_arrays(pa.array(np.arange(0, (r + 1) * C, C, dtype=np.int32)), inner)
        acts = pa.ExtensionArray.from_storage(self.ext_type, outer)
        tids = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(ids, np.int32).reshape(-1)), C)
        try:
            self._writer.write_batch(pa.RecordBatch.from_arrays([acts, tids], schema=self.schema))
        except OSError as e:  # pyarrow's names no file
            e.filename = e.filename or str(self.root / self.files[-1])
            raise
        if sync_file_range is not None:  # start this batch's writeback: the file's fsync waits only for the tail
            sync_file_range(self._sink.fileno(), 0, 0, SYNC_FILE_RANGE_WRITE)
        self.rows += r
        self._file_rows += r
        self.tokens += int(np.count_nonzero(ids != NO_TOKEN))

    def _roll(self) -> None:
        self._finish()
        name = f"part-{len(self.files):05d}.arrow"
        self.files.append(name)
        self._sink = self.pa.OSFile(str(self.root / name), "wb")
        self._writer = self.pa.ipc.new_stream(self._sink, self.schema)
        self._file_rows = 0

    def _finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None
            fd = os.open(self.root / self.files[-1], os.O_RDONLY)  # durable before it is published
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> list[str]:
        """Close the last file; name the files data-NNNNN-of-NNNNN.arrow as datasets does."""
        self._finish()
        n = len(self.files)
        names = []
        for k, f in enumerate(self.files):
            name = f"data-{k:05d}-of-{n:05d}.arrow"
            os.rename(self.root / f, self.root / name)
            names.append(name)
        return names


def _config(
    store: Reader,
    hook: str,
    C: int,
    D: int,
    out: Path,
    rows: int,
    prompts: int,
    codes: list[int],
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The SAELens settings that read this export (LanguageModelSAERunnerConfig fields), and
    what checks it: the row count and each data file's size and sha256 (saelens/check.py)."""
    return {
        "hook_name": hook,
        "context_size": C,
        "d_in": D,
        "use_cached_activations": True,
        "cached_activations_path": str(out),
        "exclude_special_tokens": codes,  # -1: the filler of the last rows (never a real token)
        "store_batch_size_prompts": prompts,  # divides the row count: SAELens reads every row
        "n_batches_in_buffer": max(20, -(-2 * TRAIN_BATCH_TOKENS // C)),  # buffer >= train_batch_size_tokens
        "train_batch_size_tokens": TRAIN_BATCH_TOKENS,
        "dtype": "float32",
        "model_name": store.config.model_id,
        "n_rows": rows,
        "files": records,
    }


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
