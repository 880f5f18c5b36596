"""The keywords TokenStream took before its named constructors, kept for one release.

`TokenStream(path, follow=True, ...)` and `TokenStream(stores, aligned=True, ...)` warn
(DeprecationWarning naming the new spelling) and make a TokenStream that stands in for
what `TokenStream.follow(...)` / `TokenStream.aligned(...)` make: every method and
attribute is the made stream's (`forwarded`, TokenStream.__getattr__), so the batches,
states and errors are the same. Delete this module with the keywords.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from actstore.read.api import ReaderLike

F = TypeVar("F", bound=Callable[..., Any])
_SPECIAL: dict[str, Callable[[Any], Any]] = {"__len__": len, "__iter__": iter}


def forwarded(method: F) -> F:
    """`method`, or, on a stream made with a deprecated keyword, the same method of the
    stream it stands for (special methods such as __iter__ are looked up on the class,
    so __getattr__ alone cannot forward them)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        legacy = vars(self).get("_legacy")
        if legacy is not None:
            special = _SPECIAL.get(method.__name__)  # len(), iter(): a TypeError where the stream has none
            return special(legacy) if special is not None else getattr(legacy, method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def legacy_stream(
    cls: Any,
    store: ReaderLike | Sequence[ReaderLike],
    spec: Any,
    *,
    follow: bool,
    aligned: bool,
    options: dict[str, Any],
) -> Any:
    """The stream `cls(store, follow=..., aligned=..., **options)` stands for, after the warning."""
    if follow and aligned:
        raise TypeError("TokenStream(path, follow=True) takes no aligned=True: follow one store's layers")
    if spec is not None:
        raise TypeError(
            f"TokenStream(..., {'follow' if follow else 'aligned'}=True) takes its options by keyword, not a StreamSpec"
        )
    if follow:
        warnings.warn(
            "TokenStream(path, follow=True, ...) is deprecated: use TokenStream.follow(path, ...)",
            DeprecationWarning,
            stacklevel=3,
        )
        return cls.follow(store, **options)
    warnings.warn(
        "TokenStream(stores, aligned=True, ...) is deprecated: use TokenStream.aligned(stores, ...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return cls.aligned(store, **options)
