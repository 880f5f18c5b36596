"""The reading interface (actstore.read.api): ActStore and SaevStore are Readers, as_reader
opens any location, and a third-party Reader that implements only the required methods
works with every consumer (selections, the loaders, xarray, the SAELens provider)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from factory import vit_store

from actstore import ActStore
from actstore.errors import SegmentNotFoundError
from actstore.layout import spec
from actstore.layout.config import make_config
from actstore.loaders import PairDataset, PairIndex, TokenStream
from actstore.read.api import Reader, as_reader
from actstore.read.saevstore import SaevStore
from actstore.read.select import is_pair, select
from actstore.read.xarray import to_dataset
from actstore.saev import export_saev
from actstore.storage import LocalStorage


class MemoryReader(Reader):
    """A Reader over an in-memory (n, L, T, D) float32 array, one fixed segment: only the
    methods the interface leaves without a body."""

    def __init__(self, acts: np.ndarray, layers: tuple[int, ...]):
        n, n_layers, t, d = acts.shape
        assert n_layers == len(layers)
        self.acts = acts
        self.path = "memory://"
        self.config = make_config(layers=layers, d_model=d, dtype="float32", tokens=t)

    def __len__(self) -> int:
        return len(self.acts)

    @property
    def meta(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "d_model": self.d_model, "dtype": self.dtype, "n_examples": len(self)}

    def segment(self, name: str) -> Any:
        seg = self.config.segment(name)
        store = self

        class View:
            t_max = seg.t_max

            def __getitem__(self, key: Any) -> np.ndarray:
                return store[key]

            def padded(self, ex: int, layer: int) -> np.ndarray:
                return store[ex, layer]

            def lengths(self) -> np.ndarray:
                return np.full(len(store), seg.t_max, np.int32)

        View.name = name
        return View()

    def field_names(self) -> tuple[str, ...]:
        return (spec.DEFAULT_SEGMENT + spec.LEN_SUFFIX,)

    def field(self, name: str) -> np.ndarray:
        if name not in self.field_names():
            raise KeyError(f"no per-sample field {name!r}; this store has {list(self.field_names())}")
        return self.segment(spec.DEFAULT_SEGMENT).lengths()

    def __getitem__(self, key: Any) -> Any:
        if not is_pair(key):
            return select(self, key)
        ex, layer = key
        return self.acts[ex, self.layers.index(self.layer_number(layer))]

    def lengths(self, ex: int) -> dict[str, int]:
        return {spec.DEFAULT_SEGMENT: self.acts.shape[2]}

    def read_into(self, ex: int, layer: int, segment: str, out: np.ndarray) -> int:
        self.config.segment(segment)
        t = self.acts.shape[2]
        out[:t] = self[ex, layer]
        return t


@pytest.fixture
def memory() -> MemoryReader:
    rng = np.random.default_rng(0)
    return MemoryReader(rng.standard_normal((5, 2, 4, 8)).astype(np.float32), layers=(3, 7))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    store = vit_store(root / "store", n=6, dtype="float16")
    res = export_saev(store, root / "dump", protocol="2.0", patches_per_shard=20, progress=False)
    return root / "store", res.path


def test_both_stores_are_readers_and_as_reader_opens_each_location(stores):
    store_path, saev_dir = stores
    act, saev = as_reader(store_path), as_reader(str(saev_dir))
    assert type(act) is ActStore and type(saev) is SaevStore
    assert isinstance(act, Reader) and isinstance(saev, Reader)
    assert as_reader(act) is act and as_reader(saev) is saev
    assert type(as_reader(LocalStorage(store_path))) is ActStore
    np.testing.assert_array_equal(saev[2, 5], act[2, 5].astype(np.float32))
    with pytest.raises(
        TypeError,
        match=re.escape("expected a store: a path, a URL, a Storage or a Reader (ActStore, SaevStore). Got int."),
    ):
        as_reader(3)


def test_field_names_are_exactly_what_field_accepts(stores):
    for reader in map(as_reader, stores):
        names = reader.field_names()
        assert names, reader
        for name in names:
            assert len(reader.field(name)) == len(reader)
        with pytest.raises(KeyError, match=re.escape(f"has {list(names)}")):
            reader.field("nope")


def test_the_saev_reader_takes_the_interface_defaults(stores):
    saev = as_reader(stores[1])
    assert saev.token_ids(0) is None and saev.stats() is None and saev.layer_names() == {}
    assert (
        saev.read_cached(0, 5, "tokens", np.empty((saev.config.segments[0].t_max, saev.d_model), np.float32)) is False
    )
    outs = [np.zeros((saev.config.segments[0].t_max, saev.d_model), np.float32) for _ in range(3)]
    saev.read_many_into([(ex, 5, "tokens", out) for ex, out in zip((0, 3, 5), outs)])
    for ex, out in zip((0, 3, 5), outs):
        np.testing.assert_array_equal(out, saev[ex, 5])


def test_a_third_party_reader_works_with_every_consumer(memory):
    acts = memory.acts
    np.testing.assert_array_equal(memory[1:4, 7], acts[1:4, 1])
    np.testing.assert_array_equal(memory[2, :], acts[2])
    assert memory.layer_number(7) == 7 and memory.segments == ("tokens",)
    with pytest.raises(SegmentNotFoundError):
        memory.read_into(0, 3, "prompt", np.empty((4, 8), np.float32))

    ts = TokenStream(memory, batch_size=4, shuffle=False, dtype=torch.float32, threads=1)
    got = torch.cat(list(ts)).numpy()
    want = np.concatenate([acts[ex, li] for ex in range(5) for li in range(2)])  # store order: example, layer
    np.testing.assert_array_equal(got, want)

    ds = PairDataset(memory, layers=[3, 7], threads=1)
    batch = ds[PairIndex(np.array([3, 0]), np.array([[7], [3]]))]
    np.testing.assert_array_equal(batch["acts"].numpy(), np.stack([acts[3, 1:2], acts[0, 0:1]]))
    np.testing.assert_array_equal(batch["lengths"].numpy(), [[4], [4]])

    xr_ds = to_dataset(memory)
    assert "sample_key" not in xr_ds
    np.testing.assert_array_equal(xr_ds.activations.sel(layer=3).isel(example=4).values, acts[4, 0])
