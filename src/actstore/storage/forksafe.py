"""obstore across fork: its client runs on a tokio runtime whose threads do not survive
`fork()`, so any obstore call in a process forked after the parent used obstore blocks
forever (tokio-rs/tokio#4301; obstore is documented as not fork-safe) and a fresh client
does not help (the runtime is process-global). This module notes when this process first
uses obstore; a child forked after that refuses every obstore call with ForkedClientError,
which a DataLoader worker passes to its parent, instead of hanging. Processes started by
'spawn' or 'forkserver' start clean and build their own clients.
"""

from __future__ import annotations

import os
from typing import Any

from actstore.errors import ForkedClientError

_used_in: int | None = None  # the pid that started obstore's runtime (None: not started here)
_inherited = False  # this process was forked from one whose runtime had started


def _after_fork_in_child() -> None:
    global _inherited
    _inherited = _inherited or _used_in is not None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def started() -> bool:
    """Whether this process (or one it was forked from) has used obstore."""
    return _used_in is not None or _inherited


def obstore_for(url: str) -> Any:
    """The obstore module, for a call on `url`; refuses in a child forked after obstore started."""
    global _used_in
    if _inherited:
        raise ForkedClientError(
            f"cannot read {url} in process {os.getpid()}: it was forked from a process that had already used obstore, "
            "whose client does not survive fork (it would hang). Start DataLoader workers with "
            "multiprocessing_context='spawn' or 'forkserver' (TokenStream.loader and PairDataset.loader do so by "
            "themselves for stores in object storage), or copy the store to a local disk (`actstore cp`)"
        )
    try:
        import obstore
    except ImportError:  # pragma: no cover - obstore is a declared dependency
        raise ImportError("stores in object storage need obstore: pip install obstore") from None
    if _used_in is None:
        _used_in = os.getpid()
    return obstore


def worker_context(storage: Any, num_workers: int, context: Any) -> Any:
    """The DataLoader start method for workers reading `storage`: for a store in object
    storage, 'forkserver' by default and 'fork' refused with the fix; else `context` as given."""
    if not num_workers or getattr(storage, "local_root", True) is not None:
        return context
    method = context if context is None or isinstance(context, str) else context.get_start_method()
    if method is None:
        return "forkserver"
    if method == "fork":
        raise ValueError(
            f"multiprocessing_context='fork' cannot read {storage.url}: obstore's client (tokio) does not survive fork, "
            "so forked workers would hang. Use 'spawn' or 'forkserver' (the default for stores in object storage), "
            "or num_workers=0"
        )
    return context
