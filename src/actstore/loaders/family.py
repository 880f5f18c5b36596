"""Loaders over an aligned family (docs/format.md, section 9): the sites a stream names, as
the member stores and layer numbers that hold them (actstore.read.family)."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.errors import LayerNotFoundError
from actstore.read.family import FamilyStore, is_family
from actstore.read.store import ActStore


def narrow(source: Any, layers: Any, *, aligned: bool) -> tuple[Any, Any]:
    """What a loader given a family streams: (member store, its layer numbers) for sites of
    one member, or with `aligned` ([member store per site], [[layer] per site]). A source
    that is no family is returned with `layers` as they are.

    Args:
        source: a FamilyStore, a family root, or anything else.
        layers: a site (a name, or (model, name)) or a list of sites.
        aligned: the sites are streamed side by side (any widths, any models).
    """
    if not isinstance(source, FamilyStore):
        if not is_family(source):
            return source, layers
        source = ActStore(source)
    if layers is None or (isinstance(layers, (list, tuple)) and not layers):
        raise LayerNotFoundError(
            f"{source.path} is a family: name the sites to stream, layers=[...]; it holds {site_list(source)}"
        )
    keys = [layers] if isinstance(layers, str) or one_site(source, layers) else list(layers)
    found = [(key, *source.site(key)) for key in keys]
    if aligned:
        return [store for _, store, _ in found], [[layer] for _, _, layer in found]
    if len({id(store) for _, store, _ in found}) > 1:
        widths = ", ".join(f"{key!r}: width {store.d_model}" for key, store, _ in found)
        raise LayerNotFoundError(
            f"the sites lie in different members of family {source.path} ({widths}): stream one member's sites "
            "at a time, or several side by side with aligned=True"
        )
    return found[0][1], [layer for _, _, layer in found]


def one_site(family: FamilyStore, key: Any) -> bool:
    """Whether `key` is one (model, site) pair rather than a list of sites."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str)):
        return False
    model = key[0]
    if isinstance(model, (int, np.integer)) and not isinstance(model, bool):
        return True
    return isinstance(model, str) and model in family.model_ids and model not in {s["site"] for s in family.sites()}


def site_list(family: FamilyStore) -> list[str]:
    """The family's sites as a stream names them, for messages."""
    one = family.family.n_models == 1
    return [s["site"] if one else f"({s['model']}, {s['site']!r})" for s in family.sites()]
