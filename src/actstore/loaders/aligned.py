"""Aligned multi-source token streams: several layers, or several stores captured from
different models on the same tokens, with one shuffle, so that row i of every source's
tensor is the same token.

`TokenStream.aligned(store, layers=[4, 8, 12])` or
`TokenStream.aligned([store_a, store_b], layers=[6])` builds an AlignedTokenStream:
one single-layer TokenStream per source (store, layer). Their epoch plans are pure
functions of (unit counts, seed, epoch, batch size, window size, run length)
(actstore/loaders/plan.py); the sources have the same unit counts (checked: same examples,
lengths and masks, and the same token ids where the stores keep them) and are given the same
sizes, so every source yields the same tokens in the same order, batch for batch, worker for
worker. Each source reads and normalises with its own store and statistics; the shuffle
window (`buffer_bytes`) counts the rows of all sources together.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from actstore.errors import AlignmentError
from actstore.loaders.base import BaseTokenStream
from actstore.loaders.plan import rank_batches
from actstore.loaders.position import StreamPosition
from actstore.loaders.spec import StreamSpec
from actstore.read.api import Reader, ReaderLike, as_reader

STATE_FORMAT = "actstore.AlignedTokenStream"
STATE_VERSION = 1
_END = object()


class AlignedTokenStream(BaseTokenStream):
    """Batches of k aligned sources: a tuple of k tensors (batch, D_source), row i the same
    token in each, or one (batch, k, D) tensor with `stack=True`.

    Sources are (store, layer) pairs, store-major: `layers` of the first store, then of
    the next. Built by `TokenStream.aligned(stores, ...)`, which takes the same options
    as TokenStream (a StreamSpec); `normalize` uses each store's own statistics per
    layer. Resume (`state_dict`/`load_state_dict`, `position`), ranks,
    `loader(num_workers=...)` work as for TokenStream.

    Args:
        stores: one store, or a sequence of stores captured on the same tokens.
        spec: the options (its `layers` is ignored: see `layers`).
        make_stream: builds one source's single-layer stream (TokenStream(store, spec)).
        layers: layer numbers per store (default: every stored layer of the first store);
            a list of lists gives each store its own.
        stack: yield one (batch, k, D) tensor (sources of one width and dtype).
        check_token_ids: compare the stores' token ids where both keep them (reads them all once).
    """

    def __init__(
        self,
        stores: ReaderLike | Sequence[ReaderLike],
        spec: StreamSpec,
        *,
        make_stream: Callable[..., Any],
        layers: Any = None,
        stack: bool = False,
        check_token_ids: bool = True,
    ):
        stores = [as_reader(s) for s in (stores if isinstance(stores, (list, tuple)) else [stores])]
        if not stores:
            raise ValueError("TokenStream.aligned() needs at least one store")
        per_store = _layers_per_store(stores, layers)
        self.stores: list[Reader] = stores
        self.spec = spec
        self.stack = bool(stack)
        self.return_index = spec.return_index
        n_src = sum(len(x) for x in per_store)
        child = replace(spec, threads=max(2, spec.threads // n_src))
        self.sources: list[tuple[int, int]] = [(si, int(layer)) for si, ls in enumerate(per_store) for layer in ls]
        self.streams = [make_stream(stores[si], replace(child, layers=[layer])) for si, layer in self.sources]
        for si in range(1, len(stores)):
            check_same_tokens(stores[0], stores[si], self.streams[0], self.streams[self._first_of(si)], check_token_ids)
        first = self.streams[0]
        # One window size and run length for every source, from their rows together.
        row_bytes = sum(s.d_model * s.stored_dtype.itemsize for s in self.streams)
        window_batches = max(1, spec.buffer_bytes // (row_bytes * first.batch_size))
        unit_bytes = row_bytes * sum(seg.t_pad for seg in first.segments) / len(first.segments)
        run = max(1, int(spec.run_bytes // unit_bytes))
        for s in self.streams:
            s.share_window(window_batches, run)
        if self.stack and len({(s.d_model, s.dtype) for s in self.streams}) > 1:
            raise ValueError(
                "stack=True needs sources of one width and dtype; these have "
                f"{sorted({(s.d_model, str(s.dtype)) for s in self.streams})}: leave stack=False for a tuple"
            )
        self.batch_size, self.rank, self.world_size = first.batch_size, first.rank, first.world_size
        self.drop_last, self.n_tokens, self.device = first.drop_last, first.n_tokens, first.device
        self.position = StreamPosition(seed=spec.seed)

    @property
    def seed(self) -> int:
        """The shuffle seed of the epochs (a loaded state brings its own)."""
        return self.position.seed

    def _first_of(self, store_index: int) -> int:
        return next(i for i, (si, _) in enumerate(self.sources) if si == store_index)

    def __len__(self) -> int:
        b0, b1 = rank_batches(self.n_tokens, self.batch_size, self.rank, self.world_size, self.drop_last)
        return b1 - b0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last consumed batch (JSON-serialisable)."""
        self._push()
        inner = self.streams[0].state_dict()
        return {
            **inner,
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "sources": [[str(getattr(self.stores[si], "path", si)), layer] for si, layer in self.sources],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position saved by state_dict() of an identically configured stream."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                "not an aligned TokenStream state (expected a dict from state_dict() of a TokenStream.aligned(...) stream)"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"aligned TokenStream state version {state.get('version')!r}; this actstore reads version {STATE_VERSION}"
            )
        want = [layer for _, layer in self.sources]
        got = [s[1] for s in state.get("sources", [])]
        if got != want:
            raise ValueError(f"the saved position belongs to a stream of layers {got}; this one streams {want}")
        for s in self.streams:
            mine = s.state_dict()
            s.load_state_dict({**state, "format": mine["format"], "version": mine["version"]})
        self.position.copy_from(self.streams[0].position)

    def release(self) -> None:
        """Give back every source's buffers and mappings (TokenStream.release)."""
        for s in self.streams:
            s.release()

    def _push(self) -> None:
        """The position (kept here) into every source stream before it iterates."""
        for s in self.streams:
            s.position.copy_from(self.position)

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        in_main = get_worker_info() is None
        if not in_main:
            self.position.from_loader()
        self._push()
        its = [iter(s) for s in self.streams]
        try:
            while True:
                parts = [next(it, _END) for it in its]
                if parts[0] is _END:
                    if any(p is not _END for p in parts):
                        raise AlignmentError("aligned sources ended at different batches (internal error): report this")
                    break
                if in_main:
                    self.position.advance()
                yield self._combine(parts)
            if in_main:
                self.position.end_epoch()
        finally:
            for it in its:
                it.close()

    def _combine(self, parts: list[Any]) -> Any:
        if not self.return_index:
            return torch.stack(parts, dim=1) if self.stack else tuple(parts)  # stack: one copy
        head = parts[0]
        for p in parts[1:]:
            if not (torch.equal(p["example"], head["example"]) and torch.equal(p["token"], head["token"])):
                raise AlignmentError(
                    "aligned sources yielded different tokens in one batch (internal error): report this"
                )
        acts = [p["acts"] for p in parts]
        return {
            "acts": torch.stack(acts, dim=1) if self.stack else tuple(acts),
            "example": head["example"],
            "segment": head["segment"],
            "token": head["token"],
            "layer": torch.tensor([layer for _, layer in self.sources], dtype=torch.int64),
        }


def _layers_per_store(stores: list[Reader], layers: Any) -> list[list[int]]:
    """Each store's layer numbers: one list for all stores, or one list per store."""
    if layers is None:
        return [[int(x) for x in stores[0].layers] for _ in stores]
    if isinstance(layers, (int, np.integer)):
        return [[int(layers)] for _ in stores]
    layers = list(layers)
    if layers and all(isinstance(x, (list, tuple)) for x in layers):
        if len(layers) != len(stores):
            raise ValueError(
                f"layers gives {len(layers)} lists for {len(stores)} stores: give one list per store, or one list for all"
            )
        return [[int(v) for v in x] for x in layers]
    return [[int(v) for v in layers] for _ in stores]


def check_same_tokens(a: Reader, b: Reader, sa: Any, sb: Any, token_ids: bool) -> None:
    """Refuse two stores that do not hold the same tokens, naming the first difference."""
    name_a, name_b = str(getattr(a, "path", "store 0")), str(getattr(b, "path", "store 1"))
    if len(a) != len(b):
        raise AlignmentError(
            f"{name_b} holds {len(b)} examples, {name_a} {len(a)}: aligned stores must be captured on the same inputs"
        )
    segs_a, segs_b = [s.name for s in sa.segments], [s.name for s in sb.segments]
    if segs_a != segs_b:
        raise AlignmentError(
            f"{name_b} streams segments {segs_b}, {name_a} {segs_a}: pass segments= naming the same ones"
        )
    for si, seg in enumerate(segs_a):
        la, lb = sa.units.lengths[:, si], sb.units.lengths[:, si]
        bad = np.flatnonzero(la != lb)
        if len(bad):
            ex = int(bad[0])
            raise AlignmentError(
                f"example {ex}, segment {seg!r}: {name_a} holds {int(la[ex])} tokens, {name_b} {int(lb[ex])}: "
                "aligned stores must be captured on the same tokens"
            )
    if not np.array_equal(sa.units.counts, sb.units.counts):
        ex = int(np.flatnonzero(sa.units.kept_ex.reshape(-1) != sb.units.kept_ex.reshape(-1))[0]) // len(segs_a)
        raise AlignmentError(
            f"example {ex}: the token masks keep different tokens in {name_a} and {name_b}; use one mask for both"
        )
    have = [bool(getattr(getattr(s, "config", None), "token_ids", False)) for s in (a, b)]
    if not token_ids:
        return
    if not all(have):
        warnings.warn(
            f"{name_a if not have[0] else name_b} keeps no token ids: the stores' alignment is checked by lengths only",
            stacklevel=3,
        )
        return
    for si, seg in enumerate(segs_a):
        ia, ib = np.asarray(a.field(f"{seg}_token_ids")), np.asarray(b.field(f"{seg}_token_ids"))
        within = np.arange(ia.shape[1])[None, :] < sa.units.lengths[:, si : si + 1]
        diff = np.argwhere((ia != ib) & within)
        if len(diff):
            ex, t = (int(v) for v in diff[0])
            raise AlignmentError(
                f"example {ex}, segment {seg!r}, token {t}: token id {int(ia[ex, t])} in {name_a} but "
                f"{int(ib[ex, t])} in {name_b}: aligned stores must be captured on the same tokens"
            )
