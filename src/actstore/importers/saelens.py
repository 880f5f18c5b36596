"""`actstore import-saelens`: a SAELens cached-activations dataset -> an actstore store.

The source is what SAELens's CacheActivationsRunner (or `actstore export-saelens`) writes,
a `datasets.save_to_disk` folder: `state.json` (`_data_files`: the Arrow stream files in
order), `dataset_info.json` (`features`: the hook's column `Array2D((C, d_in))` and
`token_ids`, int32 of length C), and the Arrow files. Read with pyarrow record batch by
record batch (a local file memory-mapped; an object-store file by range requests), so
memory stays bounded whatever the size.

Mapping: each row -> one example of the fixed segment "tokens" (T = C); trailing token id
-1 (the filler of export-saelens's last rows) ends the example early; real token ids -> the
store's token ids; the codes export-saelens writes for a store without ids (-2 content,
-3 special, -4 chat template) -> token labels 0 / 1 / 2 (when its saelens_config.json
excludes -3) or nothing. The hook -> one layer (--layer, else the number in
`blocks.N....` / `layers.N`, else 0). Values stay in the column's dtype (float32 or
float16: exact). Each Arrow file becomes one writer shard (driver.py).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from actstore.errors import SaelensDatasetError
from actstore.importers.driver import Examples, Geometry, Part
from actstore.importers.files import local_file, local_size, read_bytes
from actstore.layout.spec import TOKEN_KIND_NAMES
from actstore.storage import KeyNotFound, open_storage

STATE, INFO, CONFIG = "state.json", "dataset_info.json", "saelens_config.json"
NO_TOKEN, CONTENT, SPECIAL, TEMPLATE = -1, -2, -3, -4
MAX_JSON_BYTES = 64 * 2**20
READ_BYTES = 8 * 2**20  # range request size for object-store files
BATCH_BYTES = 64 * 2**20  # activation bytes appended per batch


class SaelensSource:
    """A `save_to_disk` folder of SAELens cached activations (local or an object-store URL).

    Args:
        src: the folder.
        hook_name: the column to import (default: the folder's only Array2D column).
        layer: the store's layer number (default: from the hook name).
    """

    kind = "saelens"

    def __init__(self, src: Any, *, hook_name: str | None = None, layer: int | None = None):
        self.storage = storage = open_storage(src)
        self.url = storage.url.rstrip("/")
        state, info = self._json(STATE), self._json(INFO)
        features = info.get("features") if isinstance(info, dict) else None
        if not isinstance(features, dict):
            raise SaelensDatasetError(f"{self.url}/{INFO} has no features object: not a datasets save_to_disk folder")
        hooks = [k for k, v in features.items() if isinstance(v, dict) and v.get("_type") == "Array2D"]
        if hook_name is None:
            if len(hooks) != 1:
                raise SaelensDatasetError(
                    f"{self.url}/{INFO} holds Array2D columns {hooks}: pass --hook-name, one of them"
                )
            hook_name = hooks[0]
        elif hook_name not in hooks:
            raise SaelensDatasetError(
                f"{self.url}/{INFO}: the dataset holds activations of {hooks}, not of {hook_name!r}; "
                f"pass --hook-name {hooks[0] if hooks else 'NAME'} (SAELens caches one hook per folder)"
            )
        feat = features[hook_name]
        shape, dtype = feat.get("shape"), feat.get("dtype")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) and x > 0 for x in shape)):
            raise SaelensDatasetError(
                f"{self.url}/{INFO}: column {hook_name!r} has shape {shape!r}; expected [context_size, d_in]"
            )
        if dtype not in ("float32", "float16"):
            raise SaelensDatasetError(
                f"{self.url}/{INFO}: column {hook_name!r} is {dtype!r}; import-saelens reads float32 or float16"
            )
        self.hook, (self.C, self.D), self.dtype = hook_name, shape, dtype
        self.has_ids = "token_ids" in features
        files = state.get("_data_files") if isinstance(state, dict) else None
        if (
            not isinstance(files, list)
            or not files
            or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files)
        ):
            raise SaelensDatasetError(
                f"{self.url}/{STATE}: _data_files must list the Arrow files ({{'filename': ...}}). Got {files!r}."
            )
        names = [f["filename"] for f in files]
        bad = [n for n in names if "/" in n or n.startswith(".")]
        if bad:
            raise SaelensDatasetError(
                f"{self.url}/{STATE} lists {bad}: data files must be plain names inside the folder"
            )
        sizes = {e.key: e.size for e in storage.list("") if "/" not in e.key}
        missing = [n for n in names if n not in sizes]
        if missing:
            raise SaelensDatasetError(
                f"{self.url}/{STATE} lists {missing}, which are not in the folder (it holds {sorted(sizes)})"
            )
        if storage.local_root is not None:  # links are followed only inside the folder
            sizes.update({n: local_size(storage, n, self.url, SaelensDatasetError) for n in names})
        self.parts = [Part(key=n, n_examples=self._count(n), fingerprint=str(sizes[n])) for n in names]
        config = self._json(CONFIG) if CONFIG in sizes else {}
        if isinstance(config, dict) and isinstance(config.get("files"), list):
            self._check_export(config, names, sizes)
        codes = config.get("exclude_special_tokens") if isinstance(config, dict) else None
        self.ids_mode = self._ids_mode()
        labels = not self.ids_mode and isinstance(codes, list) and SPECIAL in codes
        if layer is None:
            m = re.search(r"(?:blocks|layers|layer|h)\.(\d+)", hook_name)
            layer = int(m.group(1)) if m else 0
        self.geometry = Geometry(
            layers=[int(layer)],
            d_model=self.D,
            tokens=self.C,
            dtype=dtype,
            token_ids=self.ids_mode,
            token_labels=labels,
            token_label_names=dict(TOKEN_KIND_NAMES) if labels else None,  # export-saelens's codes: token kinds
            variable=self.has_ids,
            model_id=config.get("model_name") if isinstance(config, dict) else None,
            attrs={
                "saelens": {"hook_name": hook_name, "context_size": self.C, "config": config or None},
                "hook_names": {str(int(layer)): hook_name},
            },
        )

    def _check_export(self, config: dict, names: list[str], sizes: dict[str, int]) -> None:
        """An export-saelens folder records its rows and each data file's size and sha256: a
        local folder is checked whole (actstore.saelens.verify_saelens_folder) before anything is
        imported; a remote one by its files' sizes (its bytes are read once, by the import)."""
        from actstore.saelens.check import verify_saelens_folder

        if self.storage.local_root is not None:
            rep = verify_saelens_folder(self.storage.local_root, raise_on_error=False)
            if rep.problems:
                raise SaelensDatasetError(
                    f"{self.url} does not match its export ({CONFIG}): " + "; ".join(rep.problems)
                )
            return
        problems = []
        recorded = {r.get("name"): r.get("bytes") for r in config["files"] if isinstance(r, dict)}
        for n in names:
            if n in recorded and recorded[n] != sizes[n]:
                problems.append(f"{self.url}/{n} has {sizes[n]} bytes; the export wrote {recorded[n]} (copy it again)")
        if problems:
            raise SaelensDatasetError(f"{self.url} does not match its export: " + "; ".join(problems))

    # ---- reading --------------------------------------------------------------------
    def _json(self, key: str) -> Any:
        where = f"{self.url}/{key}"
        try:
            raw = read_bytes(self.storage, key, self.url, MAX_JSON_BYTES, SaelensDatasetError)
        except KeyNotFound:
            raise SaelensDatasetError(
                f"{where} is missing: {self.url} is not a datasets save_to_disk folder "
                "(SAELens's cached activations hold state.json, dataset_info.json and data-*.arrow)"
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise SaelensDatasetError(f"{where} is not valid JSON ({e})") from None

    def _batches(self, key: str) -> Iterator[Any]:
        import pyarrow as pa

        where = f"{self.url}/{key}"
        try:
            if self.storage.local_root is not None:
                path = local_file(self.storage, key, self.url, SaelensDatasetError)
                src: Any = pa.memory_map(str(path))  # zero-copy
            else:
                src = pa.PythonFile(io.BufferedReader(_RangeFile(self.storage, key), READ_BYTES), mode="r")
            reader = pa.ipc.open_stream(src)
            if self.hook not in reader.schema.names:
                raise SaelensDatasetError(
                    f"{where} has columns {reader.schema.names}, not {self.hook!r}: it belongs to another dataset"
                )
            yield from reader
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            if isinstance(e, SaelensDatasetError):
                raise
            raise SaelensDatasetError(f"{where} is not a readable Arrow stream: truncated or damaged ({e})") from None

    def _count(self, key: str) -> int | None:
        """Rows of a local file (its batches mapped, not read); None on an object store."""
        if self.storage.local_root is None:
            return None
        return sum(b.num_rows for b in self._batches(key))

    def _rows(self, batch: Any, where: str) -> tuple[np.ndarray, np.ndarray | None]:
        import pyarrow as pa

        r, C, D = batch.num_rows, self.C, self.D
        col = batch.column(self.hook)
        arr = col.storage if isinstance(col, pa.ExtensionArray) else col
        try:
            vals = arr.flatten().flatten().to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, AttributeError) as e:
            raise SaelensDatasetError(f"{where}: column {self.hook!r} is not a list of lists of floats ({e})") from None
        if vals.size != r * C * D or vals.dtype != np.dtype(self.dtype):
            raise SaelensDatasetError(
                f"{where}: a record batch of {r} rows holds {vals.size} {vals.dtype} values in {self.hook!r}; "
                f"{INFO} says {r} x {C} x {D} {self.dtype}"
            )
        ids = None
        if self.has_ids:
            ids = batch.column("token_ids").flatten().to_numpy(zero_copy_only=False)
            if ids.size != r * C:
                raise SaelensDatasetError(
                    f"{where}: token_ids of a {r}-row record batch hold {ids.size} values; expected {r} x {C}"
                )
            ids = ids.astype(np.int64).reshape(r, C)
        return vals.reshape(r, 1, C, D), ids

    def _ids_mode(self) -> bool:
        """Real vocabulary ids (True) or export-saelens's codes / no ids (False), from the first rows."""
        if not self.has_ids:
            return False
        for b in self._batches(self.parts[0].key):
            _, ids = self._rows(b, f"{self.url}/{self.parts[0].key}")
            return bool((ids[ids != NO_TOKEN] >= 0).all())
        return True

    def read(self, part: Part, start: int) -> Iterator[Examples]:
        where = f"{self.url}/{part.key}"
        row0 = 0
        for b in self._batches(part.key):
            r = b.num_rows
            if row0 + r <= start:
                row0 += r
                continue
            acts_all, ids_all = self._rows(b, where)
            step = max(1, BATCH_BYTES // (self.C * self.D * acts_all.itemsize))  # SAELens's record batches can be GBs
            for lo in range(max(0, start - row0), r, step):
                yield self._examples(
                    acts_all[lo : lo + step], None if ids_all is None else ids_all[lo : lo + step], where, row0 + lo
                )
            row0 += r

    def _examples(self, acts: np.ndarray, ids: np.ndarray | None, where: str, first_row: int) -> Examples:
        """Rows first_row... of a part as examples: lengths from the trailing -1 filler, ids or labels."""
        g = self.geometry
        ex = Examples(acts=acts)
        if ids is not None:
            filler = ids == NO_TOKEN
            lengths = self.C - np.argmin(filler[:, ::-1], axis=1)  # trailing -1s end the example
            lengths[filler.all(axis=1)] = 0
            ex.lengths = lengths
            inside = np.arange(self.C)[None, :] < lengths[:, None]
            if g.token_ids:
                bad = np.argwhere((ids < 0) & inside)
                if len(bad):
                    i, t = (int(v) for v in bad[0])
                    raise SaelensDatasetError(
                        f"{where}: row {first_row + i}, token {t} has token id {int(ids[i, t])}: "
                        "real token ids are >= 0 (-1 only fills the end of a row)"
                    )
                ex.token_ids = np.where(inside, ids, 0)
            elif g.token_labels:
                ex.token_labels = np.select([ids == SPECIAL, ids == TEMPLATE], [1, 2], 0).astype(np.uint8)
        return ex


class _RangeFile(io.RawIOBase):
    """A read-only file over one object of a Storage, read by range requests."""

    def __init__(self, storage: Any, key: str):
        self.storage, self.key, self.pos = storage, key, 0
        self.size = storage.size(key)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.storage.get_range(self.key, self.pos, n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)
