"""The xarray backend entry point: `xarray.open_dataset(path, engine="actstore")`.

It sits beside actstore.opener (above actstore.read and actstore.saev) because it opens
any path, an actstore store or a saev directory; the Dataset itself is built by
actstore.read.xarray. Registered in pyproject.toml under `xarray.backends`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xarray as xr
from xarray.backends import BackendEntrypoint

from actstore.layout import spec
from actstore.opener import open as open_store
from actstore.read.saevstore import is_saev_dir
from actstore.read.xarray import to_dataset


class ActstoreBackendEntrypoint(BackendEntrypoint):
    """`xarray.open_dataset(path, engine="actstore", verify=None)`: an actstore store or a
    saev shard directory as the lazy Dataset of `store.to_xarray()`."""

    description = "actstore activation stores and saev shard directories, read lazily"
    open_dataset_parameters = ("filename_or_obj", "drop_variables", "verify")

    def open_dataset(  # type: ignore[override]
        self, filename_or_obj: Any, *, drop_variables: str | Iterable[str] | None = None, verify: str | None = None
    ) -> xr.Dataset:
        ds = to_dataset(open_store(os.fspath(filename_or_obj), verify=verify))
        if drop_variables is not None:
            ds = ds.drop_vars(
                [drop_variables] if isinstance(drop_variables, str) else list(drop_variables), errors="ignore"
            )
        return ds

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        try:
            path = Path(os.fspath(filename_or_obj))
        except TypeError:
            return False
        return (path / spec.MANIFEST_FILE).is_file() or is_saev_dir(path)
