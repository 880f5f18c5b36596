"""link_run: the run layout of the storage & run manifest seed.

    <runs_root>/<run_id>/
      checkpoint/   inference/
      links/train-shards -> <shards_root>/<hash>     links/val-shards -> ...
            train-dataset -> dataset root            val-dataset  -> ...
            shards -> train-shards' target           dataset -> train-dataset's target

saev's code reads links/train-shards and links/val-shards; the seed's examples resolve
links/shards and links/dataset, so both spellings are created.
"""

from __future__ import annotations

import os
from pathlib import Path

from actstore.errors import SaevOptionError
from actstore.layout import saevspec as P
from actstore.read.saevschema import read_json
from actstore.read.saevstore import is_saev_dir
from actstore.storage.files import atomic_write

RUN_DIRS = ("checkpoint", "links", "inference")


def runs_root() -> Path:
    nfs = os.environ.get("SAEV_NFS")
    if not nfs:
        raise SaevOptionError("$SAEV_NFS is not set; pass the run as a path (<runs_root>/<run_id>)")
    return Path(nfs) / "saev" / "runs"


def shards_root() -> Path:
    scratch = os.environ.get("SAEV_SCRATCH")
    if not scratch:
        raise SaevOptionError("$SAEV_SCRATCH is not set; pass shard directories as paths")
    return Path(scratch) / "saev" / "shards"


def _resolve(value: str | os.PathLike, default_root) -> Path:
    """A bare name (no '/') is looked up under the default root; anything else is a path."""
    s = os.fspath(value)
    if os.sep not in s and not os.path.exists(s):
        return default_root() / s
    return Path(os.path.abspath(s))


def link_run(
    run: str | os.PathLike,
    *,
    train_shards: str | os.PathLike,
    val_shards: str | os.PathLike | None = None,
    dataset: str | os.PathLike | None = None,
    val_dataset: str | os.PathLike | None = None,
) -> Path:
    """Create (or complete) a run directory with its checkpoint/, links/ and inference/.

    Args:
        run: `<runs_root>/<run_id>`, or a bare run id under $SAEV_NFS/saev/runs.
        train_shards: a saev `<HASH>` directory, or a bare hash under $SAEV_SCRATCH/saev/shards.
        val_shards: the same for validation (optional).
        dataset: the training data set root; default: the `dataset` of train_shards'
            metadata.json when that folder exists.
        val_dataset: the validation data set root; default: val_shards' metadata dataset.

    Returns:
        The run directory. Rerunning with the same arguments changes nothing; a link
        that already points elsewhere is an error (nothing is replaced).
    """
    run_dir = _resolve(run, runs_root)
    links = {"train-shards": _shards_dir(train_shards)}
    if val_shards is not None:
        links["val-shards"] = _shards_dir(val_shards)
    for name, explicit, shards in (
        ("train-dataset", dataset, links["train-shards"]),
        ("val-dataset", val_dataset, links.get("val-shards")),
    ):
        target = Path(os.path.abspath(explicit)) if explicit is not None else _metadata_dataset(shards)
        if target is not None:
            if not target.is_dir():
                raise SaevOptionError(f"{name} {target} is not a directory; pass the data set's root folder")
            links[name] = target
    links["shards"] = links["train-shards"]
    if "train-dataset" in links:
        links["dataset"] = links["train-dataset"]
    link_dir = run_dir / "links"
    for name, target in links.items():  # check everything before creating anything
        p = link_dir / name
        if p.is_symlink() and Path(os.readlink(p)) != target:
            raise SaevOptionError(f"{p} already points to {os.readlink(p)}, not {target}; use a new run id")
        if p.exists() and not p.is_symlink():
            raise SaevOptionError(f"{p} exists and is not a link; use a new run id")
    for d in RUN_DIRS:
        (run_dir / d).mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        p = link_dir / name
        if not p.is_symlink():
            atomic_write(p, lambda tmp, target=target: os.symlink(target, tmp))  # a link appears whole or not at all
    return run_dir


def _shards_dir(value: str | os.PathLike) -> Path:
    p = _resolve(value, shards_root)
    if not is_saev_dir(p):
        raise SaevOptionError(
            f"{p} is not a saev shard directory (no {P.METADATA_FILE} and {P.SHARDS_FILE}); "
            "pass the <HASH> directory an export printed"
        )
    return p


def _metadata_dataset(shards: Path | None) -> Path | None:
    if shards is None:
        return None
    doc, _ = read_json(shards / P.METADATA_FILE)  # regular file, bounded JSON; None when damaged
    value = doc.get("dataset") if isinstance(doc, dict) else None
    if isinstance(value, str) and os.path.isabs(value) and os.path.isdir(value):
        return Path(value)
    return None
