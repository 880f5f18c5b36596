"""Loaders over an aligned family (docs/format.md, section 9): the sites a stream names, as
the member stores and layer numbers that hold them (actstore.read.family)."""

from __future__ import annotations

from typing import Any

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
        source = FamilyStore(source, open_member=ActStore)
    if aligned:
        found = source.resolve(layers)
        return [store for _, store, _ in found], [[layer] for _, _, layer in found]
    return source.one_member(
        layers, "stream one member's sites at a time, or several side by side with TokenStream.aligned"
    )
