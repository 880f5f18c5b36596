"""What a TokenStream shares with the modules that serve it (pipeline.py, windows.py,
assemble.py, tokenloader.py), written as a type so that they need not import tokens.py
(which imports them): its options resolved against the store (fixed at construction),
its public position (StreamPosition, which the loop and a TokenLoader advance), and the
per-process state that only the loaders package touches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from actstore.loaders.plan import EpochPlan
from actstore.loaders.position import StreamPosition
from actstore.loaders.source import SegmentGeometry, TokenUnits
from actstore.read.interface import Reader

if TYPE_CHECKING:
    import torch


class StreamState(Protocol):
    """A TokenStream as its pipeline, window fills, batch assembly and TokenLoader see it."""

    # ---- options resolved against the store (TokenStream's StreamSpec) ---------------
    store: Reader
    units: TokenUnits
    segments: tuple[SegmentGeometry, ...]
    batch_size: int
    d_model: int
    dtype: torch.dtype
    stored_dtype: np.dtype
    device: torch.device | None
    gather_threads: int
    threads: int
    prefetch: int
    prefetch_batches: int
    mmap: bool
    pin_memory: bool
    return_index: bool

    # ---- where it stands -----------------------------------------------------------------
    position: StreamPosition

    @property
    def seed(self) -> int: ...

    # ---- per-process state, private to the loaders package -----------------------------
    _norm: tuple[np.ndarray, np.ndarray] | None  # (shift, scale) per (layer, segment) key
    _worker_slots: Any  # under a TokenLoader with workers: their shared slots' state (buffers.WorkerSlots)

    def plan(self, epoch: int | None = None) -> EpochPlan: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
