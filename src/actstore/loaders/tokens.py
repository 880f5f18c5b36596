"""TokenStream: shuffled (batch_size, D) batches of single token vectors for SAE training.

The order is EpochPlan's (actstore/loaders/plan.py): shuffled units, each rank a
contiguous run of batches, windows of `buffer_bytes` read whole and permuted in memory,
windows dealt to DataLoader workers. The reading happens in TokenPipeline
(actstore/loaders/pipeline.py), one per consumer (a worker, or the main process). The
options are one StreamSpec (actstore/loaders/spec.py); where the stream stands is its
StreamPosition (actstore/loaders/position.py). The other kinds of stream have named
constructors: `TokenStream.aligned(...)`, `TokenStream.follow(...)` (actstore/loaders/base.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import numpy as np
import torch
from torch.utils.data import get_worker_info

from actstore.loaders.aligned import AlignedTokenStream
from actstore.loaders.base import BaseTokenStream
from actstore.loaders.buffers import TORCH_DTYPES
from actstore.loaders.deprecated import forwarded, legacy_stream
from actstore.loaders.family import narrow
from actstore.loaders.pipeline import Spares, TokenPipeline
from actstore.loaders.plan import EpochPlan, consumed_per_worker, rank_batches
from actstore.loaders.position import StreamPosition
from actstore.loaders.source import TokenUnits, pick_layers, pick_segments, stats_tables, stored_numpy_dtype
from actstore.loaders.spec import FollowOptions, LoaderOptions, SourceOptions, StreamOptions, StreamSpec, make_spec
from actstore.read.api import Reader, ReaderLike, as_reader
from actstore.storage import Storage

if TYPE_CHECKING:
    from actstore.loaders.follow import FollowStream
    from actstore.loaders.tokenloader import TokenLoader

STATE_FORMAT = "actstore.TokenStream"
STATE_VERSION = 1
# State fields that must match for a saved position to mean the same batches.
_PLAN_FIELDS = ("n_tokens", "batch_size", "window_batches", "run", "world_size", "rank", "shuffle", "drop_last")


class TokenStream(BaseTokenStream):
    """Batches of single token vectors, in a shuffled order that is a pure function of
    (seed, epoch) and the sizes; padding and masked tokens are skipped.

    Each epoch yields every kept token vector exactly once, split disjointly over
    torch.distributed ranks and DataLoader workers. Iterating again continues where the
    last consumed batch left off (the next epoch once one is complete); `state_dict()`
    saves that position (`position`) and `load_state_dict()` restores it, so a restarted
    run yields exactly the batches the uninterrupted run would have. With DataLoader
    workers, iterate `stream.loader(num_workers=...)`: it counts the batches the loop consumed.

    Args:
        store: a Reader (an ActStore, a SaevStore from actstore.open(saev_dir)) or its location (actstore.read.api.as_reader).
        spec: the options as one StreamSpec (keywords given as well replace its fields).
        **options: StreamSpec's fields (batch_size, layers, segments, seed, shuffle,
            buffer_bytes, run_bytes, drop_last, rank, world_size, token_mask, normalize,
            dtype, return_index, threads, prefetch, prefetch_batches, pin_memory, device,
            mmap, gather_threads); see StreamSpec for each.
        follow, aligned: deprecated (one release): use TokenStream.follow(...) and
            TokenStream.aligned(...); the stream made then stands in for the one those make.

    Attributes:
        spec: the options (StreamSpec).
        position: where the stream stands (StreamPosition); a TokenLoader advances it.
        spares: the buffers and mappings kept from one iteration to the next in this
            process (actstore.loaders.pipeline.Spares; `release()` gives them back).
        layers, segments, d_model, dtype, units, n_tokens, window_batches, run: the
            options resolved against the store.
    """

    @classmethod
    def aligned(
        cls,
        stores: ReaderLike | Sequence[ReaderLike],
        *,
        layers: Any = None,
        stack: bool = False,
        check_token_ids: bool = True,
        **options: Unpack[SourceOptions],
    ) -> AlignedTokenStream:
        """Several sources in step under one shuffle, row i the same token in each: the
        `layers` of one store, or of each of several stores captured on the same tokens
        (actstore/loaders/aligned.py). Batches are a tuple of one tensor per source
        (`stack=True`: one (batch, k, D) tensor); `options` are StreamSpec's other fields."""
        spec = make_spec(None, dict(options), "TokenStream.aligned()")  # its `layers` are per store: below
        stores, layers = narrow(stores, layers, aligned=True)  # a family's sites: one member store each
        return AlignedTokenStream(
            stores, spec, make_stream=cls, layers=layers, stack=stack, check_token_ids=check_token_ids
        )

    @staticmethod
    def follow(
        store: str | os.PathLike | Storage | Reader, *, consumer: str | None = None, **options: Unpack[FollowOptions]
    ) -> FollowStream:
        """A store that writers are still filling (training while capturing): its committed
        blocks as they come, mixed in a pool of `buffer_bytes`, until it is finalized
        (actstore/loaders/follow.py). `options`: StreamSpec's fields (those a growing store
        cannot honour refused by name), `poll_s` and `idle_timeout_s`.

        With `consumer="name"`: a durable named consumer (a ConsumerStream,
        actstore/loaders/consumer.py) that registers in the store, reads the blocks its
        `rank` of `world_size` owns that it has not acknowledged, resumes from
        `state_dict()`, and acknowledges as `ack` says ("checkpoint", "manual", "yielded")."""
        if consumer is not None:
            from actstore.loaders.consumer import ConsumerStream

            return ConsumerStream(store, consumer=consumer, **options)
        if "ack" in options:
            raise ValueError("TokenStream.follow(...) takes ack= only with consumer='name' (a durable consumer)")
        from actstore.loaders.follow import FollowStream

        return FollowStream(store, **options)

    def __init__(
        self,
        store: ReaderLike,
        spec: StreamSpec | None = None,
        *,
        follow: bool = False,
        aligned: bool = False,
        **options: Unpack[StreamOptions],
    ):
        if follow or aligned:
            # (the deprecated spellings also pass the aligned and follow streams' own options)
            self._legacy = legacy_stream(type(self), store, spec, follow=follow, aligned=aligned, options=dict(options))
            return
        self.spec = spec = make_spec(spec, dict(options), "TokenStream()")
        store, layers = narrow(store, spec.layers, aligned=False)  # a family's sites: the member holding them
        self.store = store = as_reader(store)
        self.batch_size = spec.batch_size
        self.layers = pick_layers(store, layers)
        self.segments = pick_segments(store, spec.segments)
        self.shuffle, self.drop_last = spec.shuffle, spec.drop_last
        self.rank, self.world_size = spec.rank, spec.world_size
        self.d_model = int(store.d_model)
        self.stored_dtype = stored_numpy_dtype(store)
        self.dtype = TORCH_DTYPES[store.dtype] if spec.dtype is None else spec.dtype
        if spec.normalize is not None and not self.dtype.is_floating_point:
            raise ValueError(f"normalize needs a floating output dtype, got {self.dtype}")
        self.normalize = spec.normalize
        self._norm = stats_tables(store, self.layers, self.segments, spec.normalize) if spec.normalize else None
        if self._norm is not None and self.dtype in (torch.float16, torch.bfloat16) and spec.dtype is None:
            self.dtype = torch.float32  # normalised values are computed and returned in float32
        self.return_index = spec.return_index
        self.device = spec.device
        pin_memory = spec.pin_memory
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=2)
            pin_memory = False
        self.threads, self.prefetch, self.pin_memory = spec.threads, spec.prefetch, pin_memory
        self.prefetch_batches = spec.prefetch_batches
        self.mmap, self.gather_threads = spec.mmap, spec.gather_threads
        self.units = TokenUnits(store, self.layers, self.segments, spec.token_mask)
        self.n_tokens = int(self.units.counts.sum(dtype=np.int64))
        row_bytes = self.d_model * self.stored_dtype.itemsize
        unit_bytes = row_bytes * sum(seg.t_pad for seg in self.segments) / len(self.segments)
        self.window_batches = max(1, spec.buffer_bytes // (row_bytes * self.batch_size))
        self.run = max(1, int(spec.run_bytes // unit_bytes))
        self.buffer_bytes = spec.buffer_bytes
        self.position = StreamPosition(seed=spec.seed)
        # Buffers kept from one epoch to the next in this process (memory written before costs no
        # page faults): its pipelines take them and hand them back (pipeline.Spares).
        self.spares = Spares()
        self._active = 0  # iterations running (their threads use the buffers and mappings)
        self._worker_slots = None  # under a TokenLoader: its workers' shared slots (buffers.WorkerSlots)

    def share_window(self, window_batches: int, run: int) -> None:
        """Set the shuffle window (batches) and the run length (units); an aligned stream gives
        every source the same ones, from the rows of all sources together."""
        self.window_batches, self.run = int(window_batches), int(run)
        self.buffer_bytes = self.window_batches * self.batch_size * self.d_model * self.stored_dtype.itemsize

    @property
    def seed(self) -> int:
        """The shuffle seed of the epochs (a loaded state brings its own)."""
        legacy = vars(self).get("_legacy")
        return legacy.seed if legacy is not None else self.position.seed

    def __getattr__(self, name: str) -> Any:
        legacy = vars(self).get("_legacy")
        if legacy is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(legacy, name)  # a stream made with the deprecated keywords: the one it stands for

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if "_legacy" not in state:
            state["spares"] = Spares()  # buffers belong to one process
            state["_active"] = 0
        return state

    # ---- the position -------------------------------------------------------------
    @forwarded
    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch plan of `epoch` (default: the position's)."""
        return EpochPlan(
            self.units.counts,
            batch_size=self.batch_size,
            window_batches=self.window_batches,
            seed=self.seed,
            epoch=self.position.epoch if epoch is None else epoch,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            run=self.run,
        )

    @forwarded
    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        b0, b1 = rank_batches(self.n_tokens, self.batch_size, self.rank, self.world_size, self.drop_last)
        return b1 - b0

    @forwarded
    def state_dict(self) -> dict[str, Any]:
        """The position after the last consumed batch (JSON-serialisable): the position's
        seed, epoch, batches_done and num_workers, and the sizes that fix the order."""
        pos = self.position.state()
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            **pos,
            "n_tokens": self.n_tokens,
            "batch_size": self.batch_size,
            "window_batches": self.window_batches,
            "run": self.run,
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    @forwarded
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
        self.position.restore(state)

    @forwarded
    def discard_read_ahead(self) -> None:
        """Forget the next epoch's first window, read ahead at the end of the last epoch
        (to measure a cold epoch, say); its buffer is kept for reuse."""
        self.spares.discard_read_ahead()

    @forwarded
    def release(self) -> None:
        """Give back everything this stream holds between epochs in this process: window
        buffers, batch buffers, the window read ahead, and the mappings of the store's
        files (whose pages the kernel may then evict). The next epoch starts afresh."""
        if self._active:
            raise RuntimeError("release() while this stream is being iterated: finish or close the iteration first")
        self.spares.release()

    @forwarded
    def loader(self, num_workers: int = 0, **kwargs: Unpack[LoaderOptions]) -> TokenLoader:
        """A resumable loader over this stream with `num_workers` DataLoader workers."""
        from actstore.loaders.tokenloader import TokenLoader

        return TokenLoader(self, num_workers=num_workers, **kwargs)

    # ---- iteration ----------------------------------------------------------------
    @forwarded
    def __iter__(self) -> Iterator[Any]:
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        """One epoch's batches from the position on, advancing it (in this process)."""
        pos = self.position
        info = get_worker_info()
        if info is not None:
            pos.from_loader()
        plan = self.plan()
        if info is None:
            worker, n_workers, skip = 0, 1, pos.batches_done
            in_main = True
        else:
            worker, n_workers, in_main = info.id, info.num_workers, False
            if pos.batches_done and pos.num_workers != n_workers:
                raise ValueError(
                    f"this position was saved with num_workers={pos.num_workers}; resume it with the same "
                    f"number of DataLoader workers (got {n_workers})"
                )
            done, first = consumed_per_worker(plan.worker_batches(n_workers), pos.batches_done)
            worker = (worker + first) % n_workers  # continue the DataLoader's cycle where it stopped
            skip = int(done[worker])
        pipe = TokenPipeline(self, plan, plan.worker_windows(worker, n_workers), skip, not in_main, self.spares)
        self._active += 1
        try:
            for batch in pipe:
                if in_main:
                    pos.advance()
                yield batch
            if in_main:
                pos.end_epoch()
        finally:
            self._active -= 1
            pipe.close()
