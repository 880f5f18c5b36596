"""Writing an aligned family (docs/format.md, section 9): its record, and finalizing every member.

The record is written first (atomically, once), then each member store under
`members/<name>/` by the ordinary writer; `finalize(root)` finalizes every member and
checks that they hold the same examples.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from actstore import catalog
from actstore.errors import AlignmentError, StoreMismatchError
from actstore.layout import family as fam
from actstore.layout import keys
from actstore.storage import Storage, open_storage


def create_family(store: str | os.PathLike | Storage, family: fam.Family, *, resume: bool = False) -> Storage:
    """Write `family`'s record at the root `store` (nothing else); returns the root's Storage.

    Raises:
        StoreMismatchError: the root holds an ordinary store, or a family of other members
            (with resume=False, any family at all).
    """
    storage = open_storage(store)
    if catalog.has_identity(storage):
        raise StoreMismatchError(
            f"{storage.url} holds an ordinary store; write a family (several widths or models) into a new folder"
        )
    if storage.exists(fam.FAMILY_FILE):
        old = catalog.read_family(storage)
        if old != family:
            raise StoreMismatchError(
                f"{storage.url} holds a family of members {[m.name for m in old.members]} with other sites or models "
                f"than this capture's {[m.name for m in family.members]}; write into a new folder"
            )
        if not resume:
            raise StoreMismatchError(
                f"{storage.url} holds a family already; pass resume=True (--resume) to continue it, or remove the folder"
            )
        return storage
    storage.put(fam.FAMILY_FILE, family.to_json(), durable=True)
    return storage


def finalize_family(storage: Storage, finalize: Callable[..., Any], *, allow_partial: bool = False) -> list[Any]:
    """Finalize every member of the family at `storage` with `finalize` (one store's), then
    check that the members hold the same number of examples in each shard.

    Returns:
        One manifest per member, in the record's order.
    """
    family = catalog.read_family(storage)
    manifests = [finalize(storage.child(m.key), allow_partial=allow_partial) for m in family.members]
    shapes = {m.name: [s.n_examples for s in man.shards] for m, man in zip(family.members, manifests)}
    if len({tuple(v) for v in shapes.values()}) != 1:
        raise AlignmentError(
            f"the members of family {storage.url} hold different examples per shard {shapes}: they were not written "
            "from the same batches; recapture the family"
        )
    return manifests


def is_family_root(storage: Storage) -> bool:
    """A family record and no store identity at the root."""
    return not storage.exists(keys.IDENTITY) and storage.exists(fam.FAMILY_FILE)
