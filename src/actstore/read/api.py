"""The reading API in one place: the `Reader` interface (actstore.read.interface) and
`as_reader`, which turns whatever a caller passes (a path, a URL, a Storage, a Reader)
into a Reader. Consumers of stores (loaders, exporters, xarray, views) import from here.
"""

from __future__ import annotations

import os
from typing import Union

from actstore.read.family import FamilyStore, is_family
from actstore.read.interface import Reader, ReadItem, SegmentReader
from actstore.read.saevstore import SaevStore, is_saev_dir
from actstore.read.store import ActStore
from actstore.storage import Storage

__all__ = ["ReadItem", "Reader", "ReaderLike", "SegmentReader", "as_reader"]

# What a function taking a store accepts: a Reader, or where one lies.
ReaderLike = Union[Reader, str, os.PathLike, Storage]


def as_reader(source: ReaderLike, *, verify: str | None = None) -> Reader:
    """The Reader of `source`.

    Args:
        source: a Reader (returned as it is), or the location of a store: a local folder
            (an actstore store, or a saev shard directory: a SaevStore), a URL
            (`s3://...`, `gs://...`, `az://...`, `file://...`) or a Storage.
        verify: None, "fast", "deep" or "reads", for an actstore store opened here (see ActStore);
            saev directories are verified by actstore.open.

    Raises:
        TypeError: `source` is none of those.
    """
    if isinstance(source, Reader):
        return source
    if isinstance(source, (str, os.PathLike)) and not isinstance(source, Storage):
        if is_saev_dir(source):
            return SaevStore(source)
        if is_family(source):  # an aligned family (docs/format.md, section 9): its members are ActStores
            return FamilyStore(source, open_member=ActStore, member_options={"verify": verify})
        return ActStore(source, verify=verify)
    if isinstance(source, Storage):
        return ActStore(source, verify=verify)
    raise TypeError(
        f"expected a store: a path, a URL, a Storage or a Reader (ActStore, SaevStore). Got {type(source).__name__}."
    )
