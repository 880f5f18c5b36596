"""The state of a store a consumer reads, drawn when its read begins and again at its end.

The state is the sha256 of the store's manifest bytes: `ActStore.manifest_sha256` (the
bytes the reader opened) at the start, `ActStore.manifest_sha256_now()` (the bytes at the
store's location now) at the end. A view, export or `show` publishes only when the two are
the same (`check_unchanged`): a store finalized again, replaced or deleted during the read
is refused with both states named, and nothing is published. Readers without an actstore
manifest (a saev directory) have no state to compare.
"""

from __future__ import annotations

from actstore.errors import StoreChangedError
from actstore.read.interface import Reader

__all__ = ["check_unchanged", "drawn_state"]


def drawn_state(store: Reader) -> str | None:
    """The state `store` was opened in (None for a reader without a manifest)."""
    return getattr(store, "manifest_sha256", None)


def check_unchanged(store: Reader, what: str) -> str | None:
    """Raise StoreChangedError when `store` is no longer the state it was opened in; returns
    that state. `what` names the consumer ("the site", "export-saelens")."""
    drawn = drawn_state(store)
    now_of = getattr(store, "manifest_sha256_now", None)
    if drawn is None or now_of is None:
        return drawn
    now = now_of()
    if now != drawn:
        where = "it has no manifest now (deleted?)" if now is None else f"manifest sha256 {now[:12]}... at the end"
        raise StoreChangedError(
            f"{store.path} changed while {what} read it (manifest sha256 {drawn[:12]}... when the read began; "
            f"{where}): nothing was published, so what is there is unchanged; rerun once the store stays as it is"
        )
    return drawn
