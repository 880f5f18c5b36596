"""Reading a store: the reading interface every consumer uses (read.interface: Reader;
read.api: as_reader), ActStore (read.store) over one shard's files (read.shard), SaevStore
for saev directories (read.saevstore), selections of many examples and layers by slices and
lists (read.select) and a lazy xarray view of a whole store (read.xarray). read.select and
read.xarray work through the Reader interface only, so an actstore store and a saev
directory read the same way.
"""

from actstore.read.api import as_reader
from actstore.read.interface import Reader, SegmentReader

__all__ = ["Reader", "SegmentReader", "as_reader"]
