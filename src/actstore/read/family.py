"""FamilyStore: an aligned family of member stores read as one (docs/format.md, section 9).

Each member is an ordinary store (an ActStore); the family adds site names that reach across
members: `family[ex, "blocks.3.hook_mlp_out"]`, `family[ex, (1, "blocks.3.hook_resid_post")]`
(model number or model id, site). `actstore.open(root)` on a family root returns a FamilyStore.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from actstore import catalog
from actstore.errors import AlignmentError, LayerNotFoundError, StoreNotFoundError
from actstore.layout import family as fam
from actstore.layout import spec
from actstore.storage import Storage, open_storage

# A site as a caller names it: "blocks.3.hook_mlp_out", or (model number or model id, site).
SiteKey = Any


def is_family(location: Any) -> bool:
    """True when `location` is a local folder holding a family record and no manifest (a
    family in object storage is opened as FamilyStore(url, open_member=ActStore))."""
    if not isinstance(location, (str, os.PathLike)) or "://" in os.fspath(location):
        return False
    root = Path(location)
    return (root / fam.FAMILY_FILE).is_file() and not (root / spec.MANIFEST_FILE).exists()


def read_family(location: Any) -> tuple[fam.Family, Storage]:
    """The family record at `location` and the root's Storage."""
    storage = open_storage(location)
    return catalog.read_family(storage), storage


def member_location(storage: Storage, member: fam.Member) -> str | Storage:
    """Where member `member` of the family at `storage` lies: a local path, else a Storage."""
    local = storage.local_root
    return str(Path(local) / member.key) if local is not None else storage.child(member.key)


class FamilyStore:
    """Members of different widths (or models) over the same examples and tokens.

    Args:
        path: the family root (holding family.json).
        open_member: opens one member store (ActStore, with the keyword options below).
        member_options: ActStore's options (verify, cache_dir, cache_bytes), given to every member.

    Raises:
        AlignmentError: the members hold different numbers of examples.
    """

    def __init__(self, path: Any, *, open_member: Callable[..., Any], member_options: Mapping[str, Any] | None = None):
        options = dict(member_options or {})
        self.family, storage = read_family(path)
        local = storage.local_root
        self.path: Path | str = local if local is not None else storage.url
        self.members = {}
        for m in self.family.members:
            try:
                self.members[m.name] = open_member(member_location(storage, m), **options)
            except StoreNotFoundError as e:
                raise StoreNotFoundError(
                    f"family {self.path}: member {m.name} ({', '.join(m.sites)}) was never written (the capture that "
                    "made this family stopped before it); rerun the same `actstore write` with --resume, or remove "
                    "the folder"
                ) from e
        counts = {name: len(s) for name, s in self.members.items()}
        if len(set(counts.values())) != 1:
            raise AlignmentError(
                f"the members of family {self.path} hold different numbers of examples {counts}: they were not "
                "written from the same batches; recapture the family"
            )

    def __len__(self) -> int:
        return len(self.first)

    def __repr__(self) -> str:
        parts = ", ".join(f"{m.name}: {m.width} x {list(m.sites)}" for m in self.family.members)
        return f"FamilyStore({str(self.path)!r}, n={len(self)}, {parts})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _reopen, (self.path if isinstance(self.path, str) else str(self.path), type(self.first))

    @property
    def first(self) -> Any:
        return self.members[self.family.members[0].name]

    @property
    def model_ids(self) -> list[str | None]:
        """The model id of each model number."""
        out: dict[int, str | None] = {}
        for m in self.family.members:
            out.setdefault(m.model, m.model_id)
        return [out[i] for i in range(self.family.n_models)]

    def site(self, key: SiteKey) -> tuple[Any, int]:
        """(member store, its layer number) holding `key`: a site name or (model, site)."""
        model, site = self._model_site(key)
        member = self.family.locate(site, model)
        store = self.members[member.name]
        return store, store.layer_number(site)

    def resolve(self, layers: Any) -> list[tuple[Any, Any, int]]:
        """(site key, member store, layer number) of each site `layers` names: one site (a
        name, or (model, name)) or a list of them; None names none (refused, listing the sites)."""
        if layers is None or (isinstance(layers, (list, tuple)) and not layers):
            raise LayerNotFoundError(
                f"{self.path} is a family: name the sites to read, layers=[...]; it holds {self.site_list()}"
            )
        keys = [layers] if isinstance(layers, str) or self._one_site(layers) else list(layers)
        return [(key, *self.site(key)) for key in keys]

    def one_member(self, layers: Any, then: str) -> tuple[Any, list[int]]:
        """(member store, layer numbers) of sites that one member holds; sites of several
        members are refused, naming each site's width and what to do (`then`)."""
        found = self.resolve(layers)
        if len({id(store) for _, store, _ in found}) > 1:
            widths = ", ".join(f"{key!r}: width {store.d_model}" for key, store, _ in found)
            raise LayerNotFoundError(f"the sites lie in different members of family {self.path} ({widths}): {then}")
        return found[0][1], [layer for _, _, layer in found]

    def site_list(self) -> list[str]:
        """The family's sites as a caller names them, for messages."""
        one = self.family.n_models == 1
        return [s["site"] if one else f"({s['model']}, {s['site']!r})" for s in self.sites()]

    def _one_site(self, key: Any) -> bool:
        """Whether `key` is one (model, site) pair rather than a list of sites."""
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str)):
            return False
        model = key[0]
        if isinstance(model, (int, np.integer)) and not isinstance(model, bool):
            return True
        return isinstance(model, str) and model in self.model_ids and model not in {s["site"] for s in self.sites()}

    def sites(self) -> list[dict[str, Any]]:
        """Every site: its member, model number, model id, name and width."""
        return [
            {"member": m.name, "model": m.model, "model_id": m.model_id, "site": s, "width": m.width}
            for m in self.family.members
            for s in m.sites
        ]

    def __getitem__(self, key: tuple[Any, SiteKey]) -> np.ndarray:
        """`family[ex, site]` -> (T_i, width) of example `ex` at `site` (a site name, or (model, site))."""
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"index a family as family[example, site] (site: a name or (model, name)), got {key!r}")
        store, layer = self.site(key[1])
        return store[key[0], layer]

    def token_ids(self, ex: int) -> np.ndarray | None:
        return self.first.token_ids(ex)

    def lengths(self, ex: int) -> dict[str, int]:
        return self.first.lengths(ex)

    def sample(self, ex: int) -> dict[str, Any]:
        return self.first.sample(ex)

    def check_aligned(self) -> None:
        """Refuse members that do not hold the same tokens (lengths, and token ids where kept),
        naming the first difference. Reads every member's per-sample arrays once."""
        ref_name = self.family.members[0].name
        ref = self.first
        for name, store in self.members.items():
            if store is ref:
                continue
            for seg in ref.config.segments:
                a, b = ref.segment(seg.name).lengths(), store.segment(seg.name).lengths()
                _first_difference(a, b, f"segment {seg.name!r} lengths", ref_name, name)
            if ref.config.token_ids and store.config.token_ids:
                for seg in ref.config.segments:
                    field = seg.name + "_token_ids"
                    _first_difference(ref.field(field), store.field(field), "token ids", ref_name, name)

    def to_xarray(self, *, chunks: Any = None) -> Any:
        """The family as one lazy xarray.Dataset: the first member's per-example variables and
        one variable per member, `activations_<member>` (example, <member>_layer, token,
        <member>_d_model), with coordinates `<member>_layer`, `<member>_layer_name` and
        `<member>_site` (the family's site name of each layer)."""
        from actstore.read.xarray import ACTIVATIONS, D_MODEL, LAYER, to_dataset

        base = None
        for m in self.family.members:
            ds = to_dataset(self.members[m.name], chunks=chunks)
            if base is None:
                base = ds.drop_vars([ACTIVATIONS, LAYER, "layer_name"])
                base.attrs = {"family": [x.to_json() for x in self.family.members]}
            da = ds[ACTIVATIONS].rename({LAYER: f"{m.name}_{LAYER}", D_MODEL: f"{m.name}_{D_MODEL}"})
            da = da.rename({"layer_name": f"{m.name}_layer_name"})
            store = self.members[m.name]
            by_layer = {store.layer_number(site): site for site in m.sites}
            sites = np.array([by_layer.get(int(n), "") for n in store.layers], dtype=object)
            da = da.assign_coords({f"{m.name}_site": (f"{m.name}_{LAYER}", sites)})
            base[f"{ACTIVATIONS}_{m.name}"] = da
        return base

    def info_lines(self) -> Iterator[str]:
        """What `actstore info` says of a family: one line per member."""
        yield f"family of {len(self.family.members)} members, {len(self)} examples (aligned: the same tokens in each)"
        for m in self.family.members:
            store = self.members[m.name]
            model = f"model {m.model} ({m.model_id})" if self.family.n_models > 1 else str(m.model_id)
            yield f"  {m.name}: width {m.width}, {model}, {store.dtype}, sites {', '.join(m.sites)}"

    def _model_site(self, key: SiteKey) -> tuple[int | None, str]:
        if isinstance(key, str):
            return None, key
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str):
            model = key[0]
            if isinstance(model, (int, np.integer)) and not isinstance(model, bool):
                if not 0 <= int(model) < self.family.n_models:
                    raise LayerNotFoundError(
                        f"model {model} does not exist: this family has models 0..{self.family.n_models - 1}"
                    )
                return int(model), key[1]
            ids = self.model_ids
            if isinstance(model, str) and ids.count(model) == 1:
                return ids.index(model), key[1]
            raise LayerNotFoundError(f"no model {model!r} in this family; its models are {ids} (or their numbers)")
        raise LayerNotFoundError(f"a family's site is a name (blocks.3.hook_mlp_out) or (model, name); got {key!r}")


def _first_difference(a: np.ndarray, b: np.ndarray, what: str, name_a: str, name_b: str) -> None:
    if a.shape == b.shape and np.array_equal(a, b):
        return
    rows = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1)) if a.shape == b.shape else [0]
    raise AlignmentError(
        f"members {name_a} and {name_b} differ in {what} at example {int(rows[0])}: they do not hold the same "
        "tokens; recapture the family from one set of batches"
    )


def _reopen(path: str, member_type: Any) -> FamilyStore:
    return FamilyStore(path, open_member=member_type)
