"""`actstore import-activault`: one hook of an Activault run -> an actstore store.

Activault (tilde-research/activault, pipeline/vault/hook_uploader.py) writes, per hook,
under `{run}/{hook}/`:
- `metadata.json`: {batch_size, sequence_length, dtype ("torch.bfloat16"), d_in,
  batches_per_file, shape [batch_size, sequence_length, d_in], input_ids_shape
  [batch_size, sequence_length], bytes_per_file (the size of one megabatch file)};
- `statistics.json` (optional): {mean, std, norm, M2};
- megabatches `{uuid}--{n}_{slurm_job}.saved.pt`, each `torch.save({"states":
  (batch_size * batches_per_file, sequence_length, d_in), "input_ids": (same,
  sequence_length), "tensor_bytes": int})`. Their order carries no meaning; they are
  imported in name order.

Mapping: each sequence -> one example of the fixed segment "tokens" (T = sequence_length,
Activault packs sequences, so every position is a token), its input ids -> the store's
token ids, the hook -> one layer (number: --layer, else the last number in the hook's name,
else 0), metadata and statistics -> attrs["activault"]. Values are stored in the source's
dtype (exact). Each megabatch becomes one writer shard (driver.py).

Safety: every file's size is checked against metadata.json before it is read; megabatches
are loaded with `torch.load(weights_only=True)` (a pickle that builds anything but tensors
and plain containers is refused), on a local disk memory-mapped (nothing allocated).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from collections.abc import Iterator
from typing import Any

from actstore.errors import ActivaultFormatError
from actstore.importers.driver import Examples, Geometry, Part
from actstore.importers.files import local_file, local_size, read_bytes
from actstore.storage import KeyNotFound, open_storage

METADATA, STATISTICS = "metadata.json", "statistics.json"
SUFFIX = ".pt"
DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_JSON_BYTES = 64 * 2**20
SLACK_BYTES = 1 << 20  # torch.save's zip headers and pickle, beyond the tensors' bytes
BATCH_BYTES = 64 * 2**20  # activation bytes appended per batch


class ActivaultSource:
    """One hook folder of an Activault run (local or an object-store URL).

    Args:
        src: the hook folder `{run}/{hook}`, or the run folder with `hook`.
        hook: the hook's folder name inside a run folder.
        layer: the store's layer number for the hook (default: the last number in its name).
    """

    kind = "activault"

    def __init__(self, src: Any, *, hook: str | None = None, layer: int | None = None):
        storage = open_storage(src)
        if hook is not None:
            storage = storage.child(hook.strip("/"))
        self.storage, self.url = storage, storage.url.rstrip("/")
        entries = {e.key: e.size for e in storage.list("") if "/" not in e.key}
        if METADATA not in entries:
            hooks = sorted(
                {
                    e.key.split("/")[0]
                    for e in storage.list("")
                    if e.key.endswith("/" + METADATA) and e.key.count("/") == 1
                }
            )
            hint = (
                f"it is a run folder: pass --hook-name NAME, one of {hooks}"
                if hooks
                else "pass one hook's folder {run}/{hook} (holding metadata.json and .saved.pt megabatches), or the run folder with --hook-name NAME"
            )
            raise ActivaultFormatError(f"{self.url} has no {METADATA}: {hint}")
        self.hook = self.url.rsplit("/", 1)[-1]
        self.meta = _parse_metadata(_json(storage, METADATA, self.url), f"{self.url}/{METADATA}")
        stats = _json(storage, STATISTICS, self.url) if STATISTICS in entries else None
        m = self.meta
        self.n_per_file = m["batch_size"] * m["batches_per_file"]
        T, D, dtype = m["sequence_length"], m["d_in"], DTYPES[m["dtype"]]
        self.states_bytes = self.n_per_file * T * D * ITEMSIZE[dtype]
        files = sorted(k for k in entries if k.endswith(SUFFIX))
        if storage.local_root is not None:  # links are followed only inside the folder
            entries.update({k: local_size(storage, k, self.url, ActivaultFormatError) for k in files})
        self.parts = [self._part(k, entries[k]) for k in files]
        if layer is None:
            nums = re.findall(r"\d+", self.hook)
            layer = int(nums[-1]) if nums else 0
        self.geometry = Geometry(
            layers=[int(layer)],
            d_model=D,
            tokens=T,
            dtype=dtype,
            token_ids=True,
            attrs={
                "activault": {"hook": self.hook, "metadata": m, "statistics": stats},
                "hook_names": {str(int(layer)): self.hook},
            },
        )

    def _part(self, key: str, size: int) -> Part:
        """A megabatch, its size checked against metadata.json before anything is read."""
        where = f"{self.url}/{key}"
        want = self.meta.get("bytes_per_file")
        if want is not None and size != want:
            raise ActivaultFormatError(
                f"{where} has {size} bytes; {METADATA} says bytes_per_file {want} (truncated or replaced?)"
            )
        low = self.states_bytes + self.n_per_file * self.meta["sequence_length"] * 4  # input ids: int32 at least
        high = self.states_bytes + self.n_per_file * self.meta["sequence_length"] * 8 + SLACK_BYTES
        if not low <= size <= high:
            raise ActivaultFormatError(
                f"{where} has {size} bytes; {METADATA}'s shapes ({self.n_per_file} x {self.meta['sequence_length']} x "
                f"{self.meta['d_in']} {self.meta['dtype']}) need {low}..{high}: the file is truncated or not of this hook"
            )
        return Part(key=key, n_examples=self.n_per_file, fingerprint=f"{size}")

    def read(self, part: Part, start: int) -> Iterator[Examples]:
        obj = self._load(part)
        where = f"{self.url}/{part.key}"
        states, ids = _check_megabatch(obj, where, self.meta, self.n_per_file)
        row = self.meta["sequence_length"] * self.meta["d_in"] * ITEMSIZE[self.geometry.dtype]
        step = max(1, BATCH_BYTES // row)
        for s in range(start, self.n_per_file, step):
            e = min(s + step, self.n_per_file)
            yield Examples(acts=states[s:e].unsqueeze(1), token_ids=ids[s:e])

    def _load(self, part: Part) -> Any:
        import torch

        where = f"{self.url}/{part.key}"
        if torch.__version__ < "2.6":  # TorchVersion compares as a version
            raise ActivaultFormatError(
                f"torch {torch.__version__} is older than 2.6, whose weights-only loader can be made to run code "
                f"(CVE-2025-32434); {where} is not loaded with it: upgrade torch (pip install 'torch>=2.6')"
            )
        try:
            if self.storage.local_root is not None:  # mapped: the tensors' pages are read as they are written
                path = local_file(self.storage, part.key, self.url, ActivaultFormatError)
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            data = self.storage.get(part.key, max_bytes=part_size(part))
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ActivaultFormatError(
                f"{where} is not a weights-only torch file: its pickle builds objects other than tensors "
                f"({first}); refusing to load it (Activault megabatches hold only tensors and an int)"
            ) from None
        except KeyNotFound:
            raise ActivaultFormatError(f"{where} disappeared while importing") from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
            raise ActivaultFormatError(
                f"{where} cannot be read by torch.load: truncated or damaged ({type(e).__name__}: {e})"
            ) from None


def part_size(part: Part) -> int:
    return int(part.fingerprint)


def _json(storage: Any, key: str, url: str) -> Any:
    where = f"{url}/{key}"
    try:
        raw = read_bytes(storage, key, url, MAX_JSON_BYTES, ActivaultFormatError)
    except KeyNotFound:
        raise ActivaultFormatError(f"{where} is missing") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ActivaultFormatError(f"{where} is not valid JSON ({e})") from None


def _parse_metadata(md: Any, where: str) -> dict[str, Any]:
    if not isinstance(md, dict):
        raise ActivaultFormatError(f"{where} must be a JSON object. Got {type(md).__name__}.")
    for k in ("batch_size", "sequence_length", "d_in", "batches_per_file"):
        v = md.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ActivaultFormatError(f"{where}: {k} must be a positive int. Got {v!r}.")
    if md.get("dtype") not in DTYPES:
        raise ActivaultFormatError(f"{where}: dtype must be one of {list(DTYPES)}. Got {md.get('dtype')!r}.")
    b, t, d = md["batch_size"], md["sequence_length"], md["d_in"]
    if "shape" in md and md["shape"] != [b, t, d]:
        raise ActivaultFormatError(
            f"{where}: shape {md['shape']!r} disagrees with batch_size, sequence_length, d_in = {[b, t, d]}"
        )
    if "input_ids_shape" in md and md["input_ids_shape"] != [b, t]:
        raise ActivaultFormatError(
            f"{where}: input_ids_shape {md['input_ids_shape']!r} disagrees with batch_size, sequence_length = {[b, t]}"
        )
    bpf = md.get("bytes_per_file")
    if bpf is not None and (isinstance(bpf, bool) or not isinstance(bpf, int) or bpf < 1):
        raise ActivaultFormatError(f"{where}: bytes_per_file must be a positive int. Got {bpf!r}.")
    return md


def _check_megabatch(obj: Any, where: str, md: dict[str, Any], n: int) -> tuple[Any, Any]:
    import torch

    if not isinstance(obj, dict) or "states" not in obj or "input_ids" not in obj:
        got = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ActivaultFormatError(f"{where} must hold a dict with 'states' and 'input_ids'. Got {got}.")
    states, ids = obj["states"], obj["input_ids"]
    T, D = md["sequence_length"], md["d_in"]
    if not isinstance(states, torch.Tensor) or tuple(states.shape) != (n, T, D) or str(states.dtype) != md["dtype"]:
        desc = f"{states.dtype} {tuple(states.shape)}" if isinstance(states, torch.Tensor) else type(states).__name__
        raise ActivaultFormatError(
            f"{where}: states is {desc}; {METADATA} says {md['dtype']} {(n, T, D)} "
            "(batch_size * batches_per_file, sequence_length, d_in)"
        )
    if (
        not isinstance(ids, torch.Tensor)
        or tuple(ids.shape) != (n, T)
        or ids.dtype.is_floating_point
        or ids.dtype == torch.bool
    ):
        desc = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ActivaultFormatError(f"{where}: input_ids is {desc}; {METADATA} says integers of shape {(n, T)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
        raise ActivaultFormatError(
            f"{where}: input_ids hold {int(ids.min())}..{int(ids.max())}; vocabulary ids are 0..2**31-1"
        )
    return states, ids
