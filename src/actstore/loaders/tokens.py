"""TokenStream: shuffled (batch_size, D) batches of single token vectors for SAE training.

The order is EpochPlan's (actstore/loaders/plan.py): shuffled units, each rank a
contiguous run of batches, windows of `buffer_bytes` read whole and permuted in memory,
windows dealt to DataLoader workers. The reading happens in TokenPipeline
(actstore/loaders/pipeline.py), one per consumer (a worker, or the main process).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.loaders.family import narrow
from actstore.loaders.aligned import AlignedTokenStream
from actstore.read.api import ReaderLike, as_reader
from actstore.loaders.buffers import TORCH_DTYPES
from actstore.loaders.feed import cuda_device
from actstore.loaders.pipeline import TokenPipeline
from actstore.loaders.plan import EpochPlan, EpochPosition, consumed_per_worker, rank_batches
from actstore.read.masks import DEFAULT
from actstore.loaders.source import TokenMask, TokenUnits, pick_layers, pick_segments, stats_tables, stored_numpy_dtype

if TYPE_CHECKING:
    from actstore.loaders.tokenloader import TokenLoader

STATE_FORMAT = "actstore.TokenStream"
STATE_VERSION = 1
DEFAULT_BUFFER_BYTES = 256 * 2**20
# State fields that must match for a saved position to mean the same batches.
_PLAN_FIELDS = ("n_tokens", "batch_size", "window_batches", "run", "world_size", "rank", "shuffle", "drop_last")


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


class TokenStream(EpochPosition, IterableDataset):
    """Batches of single token vectors, in a shuffled order that is a pure function of
    (seed, epoch) and the sizes; padding and masked tokens are skipped.

    Each epoch yields every kept token vector exactly once, split disjointly over
    torch.distributed ranks and DataLoader workers. Iterating again continues where the
    last consumed batch left off (the next epoch once one is complete); `state_dict()`
    saves that position and `load_state_dict()` restores it, so a restarted run yields
    exactly the batches the uninterrupted run would have. With DataLoader workers, iterate
    `stream.loader(num_workers=...)`: it counts the batches the loop consumed.

    Args:
        store: a Reader (an ActStore, a SaevStore from actstore.open(saev_dir)) or its location (actstore.read.api.as_reader).
        batch_size: token vectors per batch (the last batch of an epoch may be smaller).
        layers: model layer numbers to stream (default all); rows of all of them are mixed.
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
        follow: stream a store that writers are still filling (training while capturing):
            its committed blocks as they come, mixed in a pool of `buffer_bytes`, until it
            is finalized (a FollowStream, actstore/loaders/follow.py).
        aligned: stream several sources in step, row i the same token in each: the
            `layers` of `store`, or of each store of a sequence of stores captured from
            several models on the same tokens; yields a tuple of one tensor per source
            (an AlignedTokenStream, actstore/loaders/aligned.py; `stack=True` gives one
            (batch, k, D) tensor).
    """

    def __new__(
        cls,
        store: ReaderLike | Sequence[ReaderLike] | None = None,
        *args: Any,
        aligned: bool = False,
        follow: bool = False,
        **kwargs: Any,
    ) -> Any:
        if follow:
            if args or aligned:
                raise TypeError("TokenStream(path, follow=True) takes its options by keyword, and no aligned=True")
            from actstore.loaders.follow import FollowStream

            return FollowStream(store, **kwargs)
        if aligned:
            if args:
                raise TypeError("TokenStream(..., aligned=True) takes its options by keyword")
            store, kwargs["layers"] = narrow(store, kwargs.get("layers"), aligned=True)  # a family's sites
            kwargs.setdefault("buffer_bytes", DEFAULT_BUFFER_BYTES)
            return AlignedTokenStream(store, make_stream=cls, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        store: ReaderLike,
        *,
        batch_size: int = 4096,
        layers: Sequence[int] | int | None = None,
        segments: Sequence[str] | str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        run_bytes: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        token_mask: TokenMask = DEFAULT,
        normalize: str | None = None,
        dtype: torch.dtype | None = None,
        return_index: bool = False,
        threads: int = 8,
        prefetch: int = 1,
        prefetch_batches: int = 2,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
        mmap: bool = True,
        gather_threads: int = 2,
        aligned: bool = False,
        follow: bool = False,
    ):
        for name, v in (("batch_size", batch_size), ("buffer_bytes", buffer_bytes), ("threads", threads)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int. Got {v!r}.")
        if isinstance(run_bytes, bool) or not isinstance(run_bytes, (int, np.integer)) or run_bytes < 0:
            raise ValueError(f"run_bytes must be an int >= 0. Got {run_bytes!r}.")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int. Got {seed!r}.")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0. Got {prefetch!r}.")
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) or prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be an int >= 1. Got {prefetch_batches!r}.")
        if isinstance(gather_threads, bool) or not isinstance(gather_threads, int) or not 1 <= gather_threads <= 8:
            raise ValueError(f"gather_threads must be an int in 1..8. Got {gather_threads!r}.")
        store, layers = narrow(store, layers, aligned=False)  # a family's sites: the member holding them
        self.store = store = as_reader(store)
        self.batch_size = int(batch_size)
        self.layers = pick_layers(store, layers)
        self.segments = pick_segments(store, segments)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.d_model = int(store.d_model)
        self.stored_dtype = stored_numpy_dtype(store)
        self.dtype = TORCH_DTYPES[store.dtype] if dtype is None else dtype
        if normalize is not None and not self.dtype.is_floating_point:
            raise ValueError(f"normalize needs a floating output dtype, got {self.dtype}")
        self.normalize = normalize
        self._norm = stats_tables(store, self.layers, self.segments, normalize) if normalize else None
        if self._norm is not None and self.dtype in (torch.float16, torch.bfloat16) and dtype is None:
            self.dtype = torch.float32  # normalised values are computed and returned in float32
        self.return_index = bool(return_index)
        self.device = cuda_device(device)
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=2)
            pin_memory = False
        self.threads, self.prefetch, self.pin_memory = int(threads), prefetch, bool(pin_memory)
        self.prefetch_batches = prefetch_batches
        self.mmap, self.gather_threads = bool(mmap), gather_threads
        self.units = TokenUnits(store, self.layers, self.segments, token_mask)
        row_bytes = self.d_model * self.stored_dtype.itemsize
        self.window_batches = max(1, int(buffer_bytes) // (row_bytes * self.batch_size))
        self.buffer_bytes = int(buffer_bytes)
        unit_bytes = row_bytes * sum(seg.t_pad for seg in self.segments) / len(self.segments)
        self.run = max(1, int(run_bytes // unit_bytes))
        self.n_tokens = int(self.units.counts.sum(dtype=np.int64))
        self._epoch = 0
        self._batches_done = 0
        self._num_workers = 0  # set by TokenLoader; the worker split the saved position refers to
        # Buffers kept from one epoch to the next in this process (memory written before costs no page faults).
        self._spare: dict[str, Any] = {}
        self._active = 0  # iterations running (their threads use the buffers and mappings)
        self._worker_flags = None  # under a TokenLoader: its workers' slot flags (buffers.WorkerRing)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_spare"] = {}
        state["_active"] = 0
        return state

    # ---- the position -------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> EpochPlan:
        return EpochPlan(
            self.units.counts,
            batch_size=self.batch_size,
            window_batches=self.window_batches,
            seed=self.seed,
            epoch=self._epoch if epoch is None else epoch,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            run=self.run,
        )

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        b0, b1 = rank_batches(self.n_tokens, self.batch_size, self.rank, self.world_size, self.drop_last)
        return b1 - b0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last consumed batch (JSON-serialisable)."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self._epoch,
            "batches_done": self._batches_done,
            "num_workers": self._num_workers,
            "n_tokens": self.n_tokens,
            "batch_size": self.batch_size,
            "window_batches": self.window_batches,
            "run": self.run,
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position saved by state_dict() of an identically configured stream."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a TokenStream state (expected a dict from TokenStream.state_dict())")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"TokenStream state version {state.get('version')!r}; this actstore reads version {STATE_VERSION}"
            )
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state.get(k)!r}, this stream {mine[k]!r}" for k in _PLAN_FIELDS if state.get(k) != mine[k]
        ]
        if diffs:
            raise ValueError(
                "the saved position belongs to a differently configured stream (" + "; ".join(diffs) + "); "
                "rebuild the stream with the same store, layers, segments, mask, batch_size, buffer_bytes, run_bytes and ranks"
            )
        self.seed = int(state["seed"])
        self._epoch, self._batches_done = int(state["epoch"]), int(state["batches_done"])
        self._num_workers = int(state["num_workers"])

    def discard_read_ahead(self) -> None:
        """Forget the next epoch's first window, read ahead at the end of the last epoch
        (to measure a cold epoch, say); its buffer is kept for reuse."""
        spare = self._spare
        if "pending" in spare:
            spare = spare["pending"].finish()
        ahead = spare.pop("ahead", None)
        if ahead is not None:
            ahead[2].release()
        self._spare = spare

    def release(self) -> None:
        """Give back everything this stream holds between epochs in this process: window
        buffers, batch buffers, the window read ahead, and the mappings of the store's
        files (whose pages the kernel may then evict). The next epoch starts afresh."""
        if self._active:
            raise RuntimeError("release() while this stream is being iterated: finish or close the iteration first")
        self.discard_read_ahead()
        spare, self._spare = self._spare, {}
        if spare.get("maker") is not None:
            spare["maker"].close()
        if spare.get("region") is not None:
            spare["region"].close()

    def _end_epoch(self) -> None:
        self._epoch += 1
        self._batches_done = 0

    def loader(self, num_workers: int = 0, **kwargs: Any) -> TokenLoader:
        """A resumable loader over this stream with `num_workers` DataLoader workers."""
        from actstore.loaders.tokenloader import TokenLoader

        return TokenLoader(self, num_workers=num_workers, **kwargs)

    # ---- iteration ----------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None:
            self._position_from_loader()
        plan = self.plan()
        if info is None:
            worker, n_workers, skip = 0, 1, self._batches_done
            in_main = True
        else:
            worker, n_workers, in_main = info.id, info.num_workers, False
            if self._batches_done and self._num_workers != n_workers:
                raise ValueError(
                    f"this position was saved with num_workers={self._num_workers}; resume it with the same "
                    f"number of DataLoader workers (got {n_workers})"
                )
            done, first = consumed_per_worker(plan.worker_batches(n_workers), self._batches_done)
            worker = (worker + first) % n_workers  # continue the DataLoader's cycle where it stopped
            skip = int(done[worker])
        pipe = TokenPipeline(self, plan, plan.worker_windows(worker, n_workers), skip, in_worker=not in_main)
        self._active += 1
        try:
            for batch in pipe:
                if in_main:
                    self._batches_done += 1
                yield batch
            if in_main:
                self._end_epoch()
        finally:
            self._active -= 1
            pipe.close()
