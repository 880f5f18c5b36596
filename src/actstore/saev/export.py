"""export_saev: an actstore store -> a saev 2.0 / 2.1 shard directory `<dump_to>/<HASH>`.

Resolves the options (plan.py), returns an identical existing directory after verifying
it, else builds the files in a hidden temporary directory (pipeline.py) and publishes it
with a rename (publish.py).
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from actstore.errors import SaevExistsError, SaevExportError, SaevOptionError
from actstore.layout import saevspec as P
from actstore.progress import say
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.read.family import FamilyStore
from actstore.read.masks import summarize
from actstore.read.state import check_unchanged
from actstore.read.store import ActStore
from actstore.saev.checksums import file_crc, sidecar_bytes
from actstore.saev.pipeline import ShardPipeline, write_labels, write_small
from actstore.saev.plan import DEFAULT_BATCH_BYTES, ExportPlan, SaevExportOptions, make_plan
from actstore.saev.publish import publish, remove_stale, temp_dir
from actstore.saev.verify import verify_saev
from actstore.storage.durable import fsync_dir
from actstore.storage.files import export_os_errors


@dataclass(frozen=True, kw_only=True)
class SaevExport:
    """Where an export landed and what it holds; `reused` when an identical one existed."""

    path: Path
    hash: str
    protocol: str
    metadata: dict[str, Any]
    n_examples: int
    n_shards: int
    nbytes: int
    reused: bool


def default_dump_to() -> Path:
    """$SAEV_SCRATCH/saev/shards (the storage & run manifest's shards_root)."""
    scratch = os.environ.get("SAEV_SCRATCH")
    if not scratch:
        raise SaevOptionError(
            "no dump_to given and $SAEV_SCRATCH is not set; pass dump_to (e.g. $SAEV_SCRATCH/saev/shards)"
        )
    return Path(scratch) / "saev" / "shards"


def export_saev(
    store: ReaderLike,
    dump_to: str | os.PathLike | None = None,
    *,
    protocol: str = "auto",
    layers: Any = None,
    segments: Any = None,
    cls: str | bool | None = None,
    family: str | None = None,
    ckpt: str | None = None,
    dataset: str | os.PathLike | None = None,
    data: Any = None,
    patches_per_shard: int | None = None,
    pixel_agg: str | None = None,
    labels: bool | None = None,
    overwrite: bool = False,
    workers: int = 2,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    fsync: bool = True,
    progress: bool = True,
    tokens_per_example: int | None = None,
    keep_special: bool = False,
    options: SaevExportOptions | None = None,
) -> SaevExport:
    """Export a finalized store as a saev shard directory `<dump_to>/<HASH>`.

    Float32, C-order (example, layer, token, d_model), examples in the store's global
    order; the last shard file is full size (sparse zero padding). Published read-only
    and atomically; rerunning with the same inputs verifies and returns the existing
    directory.

    Args:
        store: an ActStore or its location (a path, a URL, a Storage).
        dump_to: the shards root; default $SAEV_SCRATCH/saev/shards. Protocol 2.1 needs a
            path ending in saev/shards (saev's loaders check).
        protocol: "2.1" (what saev's current loaders read; the directory must sit at
            .../saev/shards/<hash>), "2.0" (the seed exactly), or "auto" (default): 2.1 where
            saev can read it (dump_to ending in saev/shards, as the default dump_to does),
            else 2.0.
        layers: model layer numbers to export, in this order (default: all stored).
        segments: segments that make up the fixed token axis, concatenated zero-padded to
            their T_max (default: all, in store order).
        cls: "keep" (token 0 is CLS, exported), "drop" (token 0 is CLS, left out) or
            "none" (no CLS); default from the store's attrs["cls_token"].
        family, ckpt, dataset, data: saev metadata; default from the store's attrs
            (ckpt from its model_id; family guessed from the model id when it names one).
        patches_per_shard: token budget per shard (2.1: max_tokens_per_shard). Default:
            at most P.DEFAULT_BUDGET, fitted to the data (the fewest examples per shard
            that keep that many shards), so files hold data, not zero padding.
        pixel_agg: "majority" (default) or "prefer-fg"; protocol 2.1 only.
        labels: write labels.bin from the store's per-token labels (default: when stored).
        tokens_per_example: stores with padded (text) segments export their real tokens
            only, packed this many to an exported example (default 1: every token exactly
            once; a tail shorter than one example is left out, with a warning), with
            example_offsets.bin mapping each back to (store example, position).
        keep_special: a text store whose labels mark token kinds exports its content
            tokens only by default (BOS, special and chat-template tokens left out, as the
            loaders' default mask does: actstore.read.masks); True exports every real token.
        overwrite: rebuild and replace an existing <HASH> directory.
        workers: reader/converter threads.
        batch_bytes: float32 bytes per work unit (memory is about (workers + 2) units).
        fsync: flush every file to disk before publishing, so that a power loss cannot
            leave a published directory with missing data (off only for scratch use).
        progress: show a progress bar.
        options: every option above as one SaevExportOptions value, instead of the
            keywords (a keyword changed from its default beside it is refused).
    """
    given = {k: v for k, v in locals().items() if k in _OPTION_NAMES}
    o = _options(options, given)
    reader = as_reader(store)
    if isinstance(reader, FamilyStore):  # a family: the member holding the sites asked, one width a run
        reader, numbers = reader.one_member(o.layers, "export one width a run (--layers naming one member's sites)")
        o = replace(o, layers=tuple(numbers))
    if not isinstance(reader, ActStore):
        where = reader.path if isinstance(store, Reader) else store
        raise SaevOptionError(f"{where} is not an actstore store (a saev directory cannot be exported again)")
    store = reader
    root = Path(os.path.abspath(default_dump_to() if dump_to is None else dump_to))
    protocol = P.choose_protocol(o.protocol, root)
    plan = make_plan(store, o, protocol=protocol)
    workers, overwrite, fsync = o.workers, o.overwrite, o.fsync
    if plan.dropped_tokens:
        warnings.warn(
            f"the last {plan.dropped_tokens} real tokens of {store.path} do not fill an exported example of "
            f"{plan.geometry.tokens_per_example} tokens and are left out (tokens_per_example=1 exports every token)",
            stacklevel=2,
        )
    if protocol == "2.1" and root.parts[-2:] != P.SHARDS_ROOT_PARTS:
        raise SaevOptionError(
            f"protocol 2.1 directories must sit at .../saev/shards/<hash> (saev's loaders check); "
            f"dump_to {root} does not end in saev/shards: pass e.g. {root / 'saev' / 'shards'}"
        )
    if workers < 1:
        raise SaevOptionError(f"workers must be a positive int. Got {workers!r}.")
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root, plan.hash)
    target = root / plan.hash
    if target.exists() and not overwrite:
        return _reuse(target, plan)
    nonfinite = sum(store.manifest.nonfinite.values())
    if nonfinite:
        warnings.warn(
            f"store {store.path} holds {nonfinite} NaN or infinite values; they are exported as they are", stacklevel=2
        )
    if o.progress:
        say(f"export-saev {plan.hash[:8]}: {summarize(store).line(keep_all=o.keep_special)}")
    with export_os_errors(f"exporting {store.path} to saev", target, "the same export-saev command"):
        published = _build(
            store,
            plan,
            root,
            target,
            overwrite=overwrite,
            workers=workers,
            batch_bytes=o.batch_bytes,
            fsync=fsync,
            progress=o.progress,
        )
    if not published:  # another process published the same hash meanwhile
        return _reuse(target, plan)
    return _result(target, plan, reused=False)


def _build(
    store: ActStore,
    plan: ExportPlan,
    root: Path,
    target: Path,
    *,
    overwrite: bool,
    workers: int,
    batch_bytes: int,
    fsync: bool,
    progress: bool,
) -> bool:
    """Write the directory beside `target` and publish it; False: another process did first."""
    protocol = plan.protocol
    tmp = temp_dir(root, plan.hash)
    try:
        pipe = ShardPipeline(store, plan, tmp, workers=workers, batch_bytes=batch_bytes, fsync=fsync, progress=progress)
        pipe.run()
        sums = dict(pipe.checksums)
        if plan.labels:
            write_labels(store, plan, tmp / P.LABELS_FILE, fsync)
            sums[P.LABELS_FILE] = file_crc(tmp / P.LABELS_FILE)
        if plan.offsets is not None:
            write_small(tmp / P.OFFSETS_FILE, plan.offsets.astype("<i8").tobytes(), fsync)
            sums[P.OFFSETS_FILE] = file_crc(tmp / P.OFFSETS_FILE)
        write_small(tmp / P.CHECKSUMS_FILE, sidecar_bytes(sums), fsync)
        counts = plan.geometry.shard_counts()
        write_small(tmp / P.SHARDS_FILE, P.shards_bytes(counts, protocol), fsync)
        write_small(tmp / P.METADATA_FILE, P.metadata_bytes(plan.metadata, protocol), fsync)
        _verified(tmp, target)
        check_unchanged(store, "export-saev")  # the files are of the state the export began with
        if fsync:
            fsync_dir(tmp)
        published = publish(tmp, target, replace=overwrite)
    except BaseException:
        _rmtree(tmp)
        raise
    if not published:
        _rmtree(tmp)
    return published


_OPTION_NAMES = tuple(f.name for f in fields(SaevExportOptions))
_DEFAULTS = SaevExportOptions()


def _options(options: SaevExportOptions | None, given: dict[str, Any]) -> SaevExportOptions:
    """`options`, or the SaevExportOptions of the keywords `given`; never both."""
    if options is None:
        return SaevExportOptions(**given)
    if not isinstance(options, SaevExportOptions):
        raise SaevOptionError(f"options must be a SaevExportOptions. Got {type(options).__name__}.")
    changed = sorted(k for k, v in given.items() if v is not getattr(_DEFAULTS, k) and v != getattr(_DEFAULTS, k))
    if changed:
        raise SaevOptionError(f"pass options= or the export's keywords, not both: got options= and {changed}")
    return options


def _verified(tmp: Path, target: Path) -> None:
    """The invariant of every export: the directory passes our own verify-saev before it is published."""
    problems = verify_saev(tmp, published_as=target).problems
    if problems:
        raise SaevExportError(
            f"the export does not verify ({'; '.join(problems)}); nothing was published (a bug: please report it)"
        )


def _reuse(target: Path, plan: ExportPlan) -> SaevExport:
    report = verify_saev(target)
    if report.problems or report.metadata != plan.metadata:
        why = "; ".join(report.problems) or "its metadata.json differs from this export's"
        raise SaevExistsError(
            f"{target} already exists but does not verify ({why}); pass overwrite=True (--overwrite) to rebuild it"
        )
    return _result(target, plan, reused=True)


def _result(target: Path, plan: ExportPlan, *, reused: bool) -> SaevExport:
    g = plan.geometry
    return SaevExport(
        path=target,
        hash=plan.hash,
        protocol=plan.protocol,
        metadata=plan.metadata,
        n_examples=g.n_examples,
        n_shards=g.n_shards,
        nbytes=g.n_examples * g.example_nbytes,
        reused=reused,
    )


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
