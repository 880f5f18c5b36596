"""The reading interface: what every consumer of a store (loaders, exporters, xarray, views)
may use, written down as a type.

`Reader` is a `typing.Protocol` that readers also subclass: ActStore (an actstore store)
and SaevStore (a saev shard directory) implement it; `actstore.read.api.as_reader` turns
a path, a URL or a Storage into one. A consumer takes a `Reader` and uses these names
only, never `hasattr`: the optional fast paths (`read_cached`, `map_unit`, grouped
requests) have defaults here that decline, so a reader without them needs no code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from actstore.layout.config import StoreConfig
from actstore.read.layers import resolve_layer

if TYPE_CHECKING:
    from pathlib import Path

    from actstore.stats import RunningStats
    from actstore.storage.mapping import FileRegion

# One read of many: (example, layer, segment name, out buffer (>= t_pad rows, D), stored dtype).
ReadItem = tuple[int, int, str, np.ndarray]


@runtime_checkable
class SegmentReader(Protocol):
    """`store.segment(name)`: one segment of every example."""

    name: str
    t_max: int

    def __getitem__(self, key: Any) -> np.ndarray | list[np.ndarray]:
        """`[ex, layer]` -> (length, D) of this segment; slices and lists as the store's."""
        ...

    def padded(self, ex: int, layer: int) -> np.ndarray:
        """(t_max, D) with the zero padding, as stored."""
        ...

    def lengths(self) -> np.ndarray:
        """This segment's length of every example, in global order."""
        ...


@runtime_checkable
class Reader(Protocol):
    """A store read-only, by (example, layer): the API every consumer uses.

    Implementations: actstore.read.store.ActStore, actstore.read.saevstore.SaevStore.
    A new reader subclasses this class, implements the methods without a body here, and
    inherits the defaults of the others.

    Attributes:
        config: the store's configuration (layers, d_model, dtype, segments with their
            t_max and t_chunk, per-sample fields, whether token labels and ids are kept,
            the capture's attrs).
        path: the store's location: a local Path, or a URL string.
    """

    config: StoreConfig
    path: Path | str

    # ---- description -----------------------------------------------------------------
    def __len__(self) -> int:
        """The number of examples."""
        ...

    @property
    def layers(self) -> tuple[int, ...]:
        """The stored model layer numbers, in stored order."""
        return self.config.layers

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def dtype(self) -> str:
        """The stored dtype's name: float16, bfloat16 or float32 (bfloat16 reads widen to float32)."""
        return self.config.dtype

    @property
    def segments(self) -> tuple[str, ...]:
        """The segment names, in stored order (`store[ex, layer]` joins them in this order)."""
        return tuple(s.name for s in self.config.segments)

    @property
    def meta(self) -> dict[str, Any]:
        """Global metadata: model id, layers, d_model, dtype, segments, n_examples, attrs."""
        ...

    def layer_names(self) -> dict[str, int]:
        """Every name a stored layer answers to -> its layer number (none by default)."""
        return {}

    def layer_number(self, layer: Any) -> int:
        """The stored layer number of `layer`: a stored number, a negative number counting
        from the last stored layer, or a name from layer_names() (actstore.read.layers)."""
        if type(layer) is int and layer in self.layers:  # the common case, on every read: no names built
            return layer
        return resolve_layer(layer, self.layers, self.layer_names())

    def segment(self, name: str) -> SegmentReader:
        """One segment (SegmentNotFoundError naming the store's segments when absent)."""
        ...

    def field_names(self) -> tuple[str, ...]:
        """Every name `field` accepts."""
        ...

    def field(self, name: str) -> np.ndarray:
        """A per-sample (or per-token: (n, t_max)) array over all examples; KeyError listing
        `field_names()` when absent."""
        ...

    def stats(self) -> RunningStats | None:
        """Running statistics per (layer, segment), or None when the store kept none."""
        return None

    # ---- reads -----------------------------------------------------------------------
    def __getitem__(self, key: Any) -> np.ndarray | list[np.ndarray]:
        """`store[ex, layer]` -> (T_i, D), padding removed; slices and lists of examples and
        layers as actstore.read.select describes."""
        ...

    def lengths(self, ex: int) -> dict[str, int]:
        """The true token count of example `ex`, per segment."""
        ...

    def token_ids(self, ex: int) -> np.ndarray | None:
        """The vocabulary ids (int32) of example `ex`'s tokens in the order of `store[ex, layer]`,
        or None when the store keeps none (the default)."""
        return None

    def read_into(self, ex: int, layer: int, segment: str, out: np.ndarray) -> int:
        """Read segment `segment` of (ex, layer) padded into `out` (stored dtype, shape
        (>= seg.t_pad, D)); returns the example's length. For loaders."""
        ...

    def read_many_into(self, items: Sequence[ReadItem]) -> None:
        """read_into of many (ex, layer, segment, out); a reader may read those of one
        object together (one request). Default: one read_into each."""
        for ex, layer, segment, out in items:
            self.read_into(ex, layer, segment, out)

    # ---- optional fast paths: the defaults decline -----------------------------------
    def check_backed(self, ex: int, segments: Any = None) -> None:
        """Before a large read: refuse metadata that claim more data than exist (default: nothing to check)."""
        return None

    def read_cached(self, ex: int, layer: int, segment: str, out: np.ndarray) -> bool:
        """read_into only when no byte must wait for a disk; False (nothing read) otherwise.
        Default: False, so the caller reads on its I/O threads."""
        return False

    @property
    def groups_requests(self) -> bool:
        """True when reads of units sharing an object (`object_of`) are worth grouping into
        one read_many_into (object storage: one request). Default False."""
        return False

    def object_of(self, ex: int, layer: int, segment: str) -> str:
        """The object holding the first chunk of (ex, layer, segment) (default: one per unit)."""
        return f"{ex}/{layer}/{segment}"

    def mappable_files(self, segments: Sequence[str]) -> tuple[int, int] | None:
        """(files, largest file's bytes) when every file of `segments` can be mapped into a
        FileRegion; None (the default) when they must be read."""
        return None

    def map_unit(self, region: FileRegion, ex: int, layer: int, segment: str) -> list[Any] | None:
        """Map the files of (ex, layer, segment) into `region`; None (the default): read it."""
        return None
