"""StreamSpec: a TokenStream's options, one frozen value checked once when it is made.

`TokenStream(store, batch_size=4096, ...)` builds a StreamSpec from its keywords
(`StreamOptions`, the same names as a typed partial, zarr's ArrayConfigParams pattern);
`TokenStream(store, spec)` takes one made beforehand, and `dataclasses.replace(spec, ...)`
derives another (an aligned stream gives each source its layer that way). What needs the
store (which layers and segments exist, its dtype and statistics) is resolved by the
stream; everything else is checked here, each message naming the value received.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypedDict

import numpy as np
import torch

from actstore.loaders.feed import cuda_device
from actstore.loaders.source import TokenMask
from actstore.read.masks import DEFAULT

DEFAULT_BUFFER_BYTES = 256 * 2**20
NORMALIZE_MODES = (None, "standardize", "scale")
MAX_GATHER_THREADS = 8


def dist_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """rank/world_size as given, else from torch.distributed when initialised, else 0/1."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(
            f"rank must be in 0..world_size-1 with world_size >= 1. Got rank={rank!r}, world_size={world_size!r}."
        )
    return rank, world_size


def _int_at_least(name: str, v: Any, low: int, what: str) -> int:
    """v as an int >= low (bools refused), else a ValueError naming `what` it must be."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"{name} must be {what}. Got {v!r}.")
    return int(v)


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """A TokenStream's options (checked when made; rank and world_size resolved, device parsed).

    Args:
        batch_size: token vectors per batch (the last batch of an epoch may be smaller).
        layers: model layer numbers (or names, -1) to stream (default all); rows of all of them are mixed.
        segments: segment names to stream (default all).
        seed: the shuffle seed.
        shuffle: False streams units and tokens in store order (evaluation).
        buffer_bytes: size of one shuffle window: tokens are mixed freely within a window
            of buffer_bytes / (D * itemsize) tokens, which spans that many tokens' worth of
            randomly chosen units. Memory is about (prefetch + 2) windows per consumer.
        run_bytes: shuffle units in runs of consecutive units (store order, which is
            disk order) of about this many bytes, so that cold reads cover longer
            stretches of the disk where seeks cost (spinning disks, some network file
            systems); 0 (default) shuffles every unit on its own.
        drop_last: drop the last partial batch and give every rank the same number of batches.
        rank, world_size: this process's share; default from torch.distributed when initialised.
        token_mask: which tokens inside each length to keep (see actstore.loaders.source);
            the default leaves out BOS, special and chat-template tokens of a text store
            whose labels mark token kinds (actstore.read.masks), "all" keeps every token.
        normalize: None, "standardize" ((x - mean) / std per dimension) or "scale"
            (x * sqrt(D) / mean L2 norm), with the store's statistics per (layer, segment).
        dtype: output dtype; None (default) keeps the stored dtype (float16 for most
            stores: half the bytes to move to the accelerator; convert there), float32
            with normalize.
        return_index: yield dicts {"acts", "example", "layer", "segment", "token"} instead of tensors.
        threads: I/O threads per consumer (reads, and pages made resident).
        prefetch: windows read ahead of the one being served.
        prefetch_batches: batches made (and, with `device`, copied to it) ahead of the one
            the loop holds (default 2).
        pin_memory: batches in pinned memory (main process, with an accelerator), for
            your own `.to(device, non_blocking=True)`.
        device: yield batches on this device (e.g. "cuda", torch.device("cuda:1")): rows
            are gathered into pinned memory and copied asynchronously on a side stream
            (dtype conversion and normalisation then run on the device); the batch is
            safe to use on your current stream. None or "cpu": CPU tensors.
        mmap: on a local store of raw chunks, map its files and gather each batch
            straight from the page cache (one copy per token); False reads every window
            into a buffer first (two copies), as object stores and caches always do.
        gather_threads: threads that gather each batch (1 to 8).
    """

    batch_size: int = 4096
    layers: Any = None
    segments: Any = None
    seed: int = 0
    shuffle: bool = True
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    run_bytes: int = 0
    drop_last: bool = False
    rank: int | None = None
    world_size: int | None = None
    token_mask: TokenMask = DEFAULT
    normalize: str | None = None
    dtype: torch.dtype | None = None
    return_index: bool = False
    threads: int = 8
    prefetch: int = 1
    prefetch_batches: int = 2
    pin_memory: bool = False
    device: str | torch.device | None = None
    mmap: bool = True
    gather_threads: int = 2

    def __post_init__(self) -> None:
        checked = {
            name: _int_at_least(name, getattr(self, name), 1, "a positive int")
            for name in ("batch_size", "buffer_bytes", "threads")
        }
        checked["run_bytes"] = _int_at_least("run_bytes", self.run_bytes, 0, "an int >= 0")
        checked["seed"] = _int_at_least("seed", self.seed, 0, "a non-negative int")
        checked["prefetch"] = _int_at_least("prefetch", self.prefetch, 0, "an int >= 0")
        checked["prefetch_batches"] = _int_at_least("prefetch_batches", self.prefetch_batches, 1, "an int >= 1")
        g = self.gather_threads
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GATHER_THREADS:
            raise ValueError(f"gather_threads must be an int in 1..{MAX_GATHER_THREADS}. Got {g!r}.")
        if self.normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize must be one of {list(NORMALIZE_MODES)}. Got {self.normalize!r}.")
        checked["rank"], checked["world_size"] = dist_rank_world(self.rank, self.world_size)
        checked["device"] = cuda_device(self.device)
        for name in ("shuffle", "drop_last", "return_index", "pin_memory", "mmap"):
            checked[name] = bool(getattr(self, name))
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # the checked value (frozen: set once, here)


class SourceOptions(TypedDict, total=False):
    """StreamSpec's fields but `layers` as keywords (TokenStream.aligned takes its layers per
    store); see StreamSpec."""

    batch_size: int
    segments: Any
    seed: int
    shuffle: bool
    buffer_bytes: int
    run_bytes: int
    drop_last: bool
    rank: int | None
    world_size: int | None
    token_mask: TokenMask
    normalize: str | None
    dtype: torch.dtype | None
    return_index: bool
    threads: int
    prefetch: int
    prefetch_batches: int
    pin_memory: bool
    device: str | torch.device | None
    mmap: bool
    gather_threads: int


class StreamOptions(SourceOptions, total=False):
    """StreamSpec's fields as keywords (TokenStream(store, **options)); see StreamSpec."""

    layers: Any


class FollowOptions(StreamOptions, total=False):
    """TokenStream.follow's keywords: StreamSpec's fields, the follow stream's clock, and a
    durable consumer's acknowledgement mode (with consumer=)."""

    poll_s: float
    idle_timeout_s: float | None
    ack: str


class LoaderOptions(TypedDict, total=False):
    """A TokenLoader's keywords besides `num_workers` (torch DataLoader's settings)."""

    pin_memory: bool
    prefetch_factor: int | None
    multiprocessing_context: Any
    timeout: float
    persistent_workers: bool


SPEC_FIELDS = tuple(f.name for f in fields(StreamSpec))


def make_spec(spec: StreamSpec | None, options: dict[str, Any], who: str) -> StreamSpec:
    """`spec` with `options` replacing its fields (a fresh StreamSpec without one); an
    unknown option is a TypeError naming it and `who` got it."""
    unknown = sorted(set(options) - set(SPEC_FIELDS))
    if unknown:
        raise TypeError(
            f"{who} got unexpected options {unknown}; its options are StreamSpec's fields {list(SPEC_FIELDS)}"
        )
    if spec is None:
        return StreamSpec(**options)
    if not isinstance(spec, StreamSpec):
        raise TypeError(f"{who} takes a StreamSpec after the store. Got {type(spec).__name__}.")
    return StreamSpec(**{**{f: getattr(spec, f) for f in SPEC_FIELDS}, **options})
