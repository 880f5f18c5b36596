"""PairDataset and PairBatchSampler: the Zarr logger seed's training pattern, b random
examples x k random layers per batch, as padded (b, k, T, D) tensors.

One dataset item is one whole batch: the sampler yields PairIndex(examples, layers) and
the dataset reads its b*k*S (example, layer, segment) slices through a thread pool (the
chunk reads release the GIL) straight into a preallocated buffer. In the main process a
ring of `n_buffers` buffers is reused once the batch it held is dropped (optionally
pinned); in a DataLoader worker each
batch is read into a fresh shared-memory tensor, which the DataLoader passes to the
main process without another copy. No lock is shared between workers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from actstore.loaders.buffers import TORCH_DTYPES, BufferRing
from actstore.loaders.feed import DeviceLoader, cuda_device
from actstore.loaders.source import (
    TokenMask,
    pick_layers,
    pick_segments,
    request_objects,
    resolve_mask,
    segment_lengths,
    stored_numpy_dtype,
)
from actstore.loaders.spec import dist_rank_world
from actstore.loaders.windows import TaskPacker
from actstore.read.api import ReaderLike, as_reader
from actstore.read.masks import DEFAULT
from actstore.storage.forksafe import worker_context


class PairIndex(NamedTuple):
    """One batch to read: examples (b,) and model layer numbers (b, k)."""

    examples: np.ndarray
    layers: np.ndarray


class PairBatchSampler(Sampler[PairIndex]):
    """Each epoch, a permutation of the examples in batches of `batch_size`, each example
    with `k` distinct random layers (ascending); a pure function of (seed, epoch).

    Ranks take contiguous, disjoint parts of the permutation (sizes differ by at most one
    example; drop_last trims so that every rank gets the same number of full batches).

    Args:
        n_examples: examples in the store (or the store itself).
        batch_size: examples per batch (b).
        k: layers per example.
        layers: the model layer numbers to choose from.
        seed, shuffle, drop_last, rank, world_size: as in torch's samplers.
    """

    def __init__(
        self,
        n_examples: int | Any,
        *,
        layers: Sequence[int],
        batch_size: int = 256,
        k: int = 2,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        n = n_examples if isinstance(n_examples, (int, np.integer)) else len(n_examples)
        self.layers = np.asarray(tuple(layers), dtype=np.int64)
        for name, v in (("batch_size", batch_size), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int. Got {v!r}.")
        if k > len(self.layers):
            raise ValueError(
                f"k={k} layers per example, but only {len(self.layers)} layers to choose from: {self.layers.tolist()}"
            )
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int. Got {seed!r}.")
        self.n_examples, self.batch_size, self.k = int(n), int(batch_size), int(k)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _rank_examples(self) -> np.ndarray:
        n = self.n_examples
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last:
            per = n // self.world_size // self.batch_size * self.batch_size
            return perm[self.rank * per : (self.rank + 1) * per]
        return perm[self.rank * n // self.world_size : (self.rank + 1) * n // self.world_size]

    def __len__(self) -> int:
        m = len(self._rank_examples())
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    def __iter__(self) -> Iterator[PairIndex]:
        exs = self._rank_examples()
        # Layer choice: its own random stream, so it does not depend on the rank split.
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        pick = np.argsort(rng.random((self.n_examples, len(self.layers))), axis=1)[:, : self.k]
        pick.sort(axis=1)
        for i in range(0, len(exs), self.batch_size):
            b = exs[i : i + self.batch_size]
            if self.drop_last and len(b) < self.batch_size:
                return
            yield PairIndex(b.astype(np.int64), self.layers[pick[b]])


class PairDataset(Dataset):
    """Reads PairIndex batches into padded tensors.

    `ds[PairIndex(examples, layers)]` returns a dict:
      - "acts": (b, k, T, D) in the stored dtype, T = sum of the chosen segments' T_max
        (segments laid out one after another, each zero-padded to its T_max);
      - "lengths": (b, S) int64, each example's length per segment;
      - "examples": (b,) and "layers": (b, k) int64 (model layer numbers);
      - "mask": (b, T) bool, True on real (and unmasked) tokens, when return_mask=True.

    In the main process the tensors are views of one of `n_buffers` reused buffers; a
    buffer is reused only once no view of the batch it held is alive (a batch you keep is
    never overwritten; one you drop costs no new allocation).

    Args:
        store: a Reader (an ActStore, a SaevStore from actstore.open(saev_dir)) or its location (actstore.read.api.as_reader).
        layers: model layer numbers to sample from (default all).
        segments: segment names to read (default all).
        threads: reader threads per process.
        n_buffers: reused output buffers in the main process.
        pin_memory: allocate those buffers in pinned memory (needs an accelerator).
        token_mask: per-token keep mask for "mask" (see actstore.loaders.source); the
            default leaves out BOS, special and chat-template tokens of a text store whose
            labels mark token kinds (actstore.read.masks), "all" keeps every token.
        return_mask: add the (b, T) mask.
    """

    def __init__(
        self,
        store: ReaderLike,
        *,
        layers: Sequence[int] | None = None,
        segments: Sequence[str] | str | None = None,
        threads: int = 8,
        n_buffers: int = 2,
        pin_memory: bool = False,
        token_mask: TokenMask = DEFAULT,
        return_mask: bool = False,
    ):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
            raise ValueError(f"threads must be a positive int. Got {threads!r}.")
        if isinstance(n_buffers, bool) or not isinstance(n_buffers, int) or n_buffers <= 0:
            raise ValueError(f"n_buffers must be a positive int. Got {n_buffers!r}.")
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: buffers are not pinned", stacklevel=2)
            pin_memory = False
        self.store = store = as_reader(store)
        self.layers = pick_layers(store, layers)
        self.segments = pick_segments(store, segments)
        self.d_model = int(store.d_model)
        self.np_dtype = stored_numpy_dtype(store)
        self.torch_dtype = TORCH_DTYPES[store.dtype]
        self.offsets = np.cumsum([0] + [s.t_max for s in self.segments])
        self.t_total = int(self.offsets[-1])
        self.lengths = np.stack([segment_lengths(store, s) for s in self.segments], axis=1)
        self.masks = [resolve_mask(store, s, token_mask) for s in self.segments]
        self.threads, self.n_buffers, self.pin_memory = threads, n_buffers, pin_memory
        self.return_mask = bool(return_mask)
        self._pid = None

    def __len__(self) -> int:
        return len(self.store)

    def sampler(self, **kwargs: Any) -> PairBatchSampler:
        """A PairBatchSampler over this dataset's examples and layers."""
        return PairBatchSampler(len(self.store), layers=self.layers, **kwargs)

    def loader(
        self,
        *,
        batch_size: int = 256,
        k: int = 2,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        prefetch_batches: int = 2,
        **dataloader_kwargs: Any,
    ) -> DataLoader | DeviceLoader:
        """A DataLoader yielding batch dicts; extra keyword arguments go to DataLoader (for a
        store in object storage, workers start by "forkserver" unless told otherwise, and
        "fork" is refused: obstore's client does not survive fork).

        device: deliver the batches' tensors on this device ("cuda", "cuda:1"): each batch
        is copied into a pinned ring and to the device on a side stream while the previous
        one trains, `prefetch_batches` ahead (actstore.loaders.feed.DeviceLoader, which
        passes `sampler`, `len` and the rest through to the DataLoader)."""
        dev = cuda_device(device)
        smp = self.sampler(
            batch_size=batch_size,
            k=k,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
        )
        if not dataloader_kwargs.get("num_workers"):
            dataloader_kwargs.pop("multiprocessing_context", None)  # DataLoader refuses these two without workers
            dataloader_kwargs.pop("timeout", None)
        else:
            dataloader_kwargs["multiprocessing_context"] = worker_context(
                getattr(self.store, "storage", None),
                dataloader_kwargs["num_workers"],
                dataloader_kwargs.get("multiprocessing_context"),
            )
        if dev is not None:
            dataloader_kwargs["pin_memory"] = False  # the feeder copies into its own pinned ring
        dl = DataLoader(self, sampler=smp, batch_size=None, **dataloader_kwargs)
        return dl if dev is None else DeviceLoader(dl, dev, prefetch=prefetch_batches)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_pool", "_ring", "_read", "_many"):
            state.pop(k, None)
        state["_pid"] = None
        return state

    def _setup(self) -> None:
        """Per-process state: the thread pool and (main process) the buffer ring."""
        if self._pid == os.getpid():
            return
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-pairs")
        in_worker = get_worker_info() is not None
        self._ring = BufferRing(
            self.n_buffers, self.torch_dtype, pin=self.pin_memory and not in_worker, shared=in_worker
        )
        self._read = self.store.read_into
        self._object_of = request_objects(self.store)
        self._many = self.store.read_many_into if self._object_of else None  # local: one read each
        self._pid = os.getpid()

    def _buffer(self, b: int, k: int) -> torch.Tensor:
        return self._ring.take((b, k, self.t_total, self.d_model))

    def __getitem__(self, index: PairIndex | tuple) -> dict[str, torch.Tensor]:
        if not (isinstance(index, tuple) and len(index) == 2):
            raise TypeError(
                "PairDataset is indexed by whole batches, PairIndex(examples, layers): use "
                "ds.loader(batch_size=...) or DataLoader(ds, sampler=ds.sampler(...), batch_size=None)"
            )
        self._setup()
        exs = np.asarray(index[0], dtype=np.int64).reshape(-1)
        lays = np.asarray(index[1], dtype=np.int64)
        if lays.ndim != 2 or lays.shape[0] != len(exs):
            raise ValueError(f"layers must have shape (b, k) = ({len(exs)}, k); got {lays.shape}")
        bad = sorted(set(lays.reshape(-1).tolist()) - set(self.layers))
        if bad:
            raise ValueError(f"layers {bad} are not among this dataset's layers {list(self.layers)}")
        if len(exs) and (exs.min() < 0 or exs.max() >= len(self.store)):
            raise IndexError(f"examples must lie in 0..{len(self.store) - 1}; got {exs.min()}..{exs.max()}")
        b, k = lays.shape
        acts = self._buffer(b, k)
        arr = acts.view(torch.int16 if acts.dtype == torch.bfloat16 else acts.dtype).numpy()
        if acts.dtype == torch.bfloat16:
            arr = arr.view(np.uint16)
        jobs = [(i, j, s) for i in range(b) for j in range(k) for s in range(len(self.segments))]
        futures = [self._pool.submit(self._read_jobs, arr, exs, lays, task) for task in self._tasks(jobs, exs, lays)]
        for f in futures:
            f.result()
        lengths = self.lengths[exs]
        out = {
            "acts": acts,
            "lengths": torch.from_numpy(lengths),
            "examples": torch.from_numpy(exs.copy()),
            "layers": torch.from_numpy(lays.copy()),
        }
        if self.return_mask:
            out["mask"] = torch.from_numpy(self._mask(exs, lengths))
        return out

    def _tasks(
        self, jobs: list[tuple[int, int, int]], exs: np.ndarray, lays: np.ndarray
    ) -> list[list[tuple[int, int, int]]]:
        """The reads split over the threads; on an object store, in store order and the reads
        of one object together (read_many_into sends them as one request)."""
        if self._object_of is None:
            step = -(-len(jobs) // self.threads) if jobs else 1
            return [jobs[i : i + step] for i in range(0, len(jobs), step)]
        jobs = sorted(
            jobs, key=lambda t: (t[2], int(exs[t[0]]), int(lays[t[0], t[1]]))
        )  # segment by segment: its own objects
        row_bytes = self.d_model * self.np_dtype.itemsize
        packer = TaskPacker(sum(self.segments[s].t_pad for _, _, s in jobs) * row_bytes, self.threads)
        tasks = []
        for i, j, s in jobs:
            obj = self._object_of(int(exs[i]), int(lays[i, j]), self.segments[s].name)
            done = packer.add((i, j, s), obj, self.segments[s].t_pad * row_bytes)
            if done:
                tasks.append(done)
        return tasks + ([packer.items] if packer.items else [])

    def _read_jobs(self, arr: np.ndarray, exs: np.ndarray, lays: np.ndarray, jobs: list[tuple[int, int, int]]) -> None:
        items, copies = [], []
        # The last token chunk of a segment may run past T_max: those reads go to one scratch
        # block of the task and their first T_max rows are copied.
        scratch = np.empty(
            (
                sum(self.segments[s].t_pad for _, _, s in jobs if self.segments[s].t_pad != self.segments[s].t_max),
                self.d_model,
            ),
            self.np_dtype,
        )
        at = 0
        for i, j, s in jobs:
            seg = self.segments[s]
            o = int(self.offsets[s])
            dest = arr[i, j, o : o + seg.t_max]
            if seg.t_pad != seg.t_max:
                copies.append((dest, scratch[at : at + seg.t_pad]))
                dest, at = copies[-1][1], at + seg.t_pad
            items.append((int(exs[i]), int(lays[i, j]), seg.name, dest))
        if self._many is not None and len(items) > 1:
            self._many(items)
        else:
            for item in items:
                self._read(*item)
        for dest, scratch in copies:
            dest[:] = scratch[: len(dest)]  # copy: the rows up to T_max

    def _mask(self, exs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        mask = np.zeros((len(exs), self.t_total), dtype=bool)
        for s, seg in enumerate(self.segments):
            o = int(self.offsets[s])
            m = np.arange(seg.t_max)[None, :] < lengths[:, s : s + 1]
            if self.masks[s] is not None:
                m &= self.masks[s][exs]
            mask[:, o : o + seg.t_max] = m
        return mask
