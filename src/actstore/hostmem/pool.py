"""Host buffers: allocated once, reused batch after batch, kept for the process's next user.

A `HostBuffer` is one flat byte buffer of a kind:
- "plain": numpy memory (large allocations are advised to use huge pages: faulted in fast);
- "pinned": page-locked memory, so that copies to and from a CUDA device run
  asynchronously (falls back to plain where CUDA is not available);
- "shared": shared memory, which a DataLoader hands to another process by handle.

A `SlotPool` lends up to `n` buffers: `take` gives a free one (making it while fewer than
`n` exist; replacing one too small), `give_back` returns it, and `take` waits, woken by a
condition, while all `n` are lent (a `fail(e)` wakes it with `e` raised). A closed pool's
free buffers go to a `Spare`: buffers kept for the next pool of this process, up to a
byte cap (allocating pinned memory, or faulting in fresh pages, costs more than copying
into memory written before).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

KINDS = ("plain", "pinned", "shared")
ALIGN = 64  # bytes: each carved array starts on a cache line


def carve_bytes(sizes: list[int]) -> int:
    """Bytes of one buffer holding arrays of `sizes` bytes, each ALIGN-aligned."""
    return sum(-(-int(n) // ALIGN) * ALIGN for n in sizes)


class HostBuffer:
    """One flat byte buffer (see the module docstring).

    Args:
        nbytes: its size.
        kind: "plain", "pinned" (plain where CUDA is not available) or "shared".
    """

    def __init__(self, nbytes: int, kind: str = "plain"):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}. Got {kind!r}.")
        self.nbytes = int(nbytes)
        self._tensor: Any = None
        if kind == "pinned" and not _cuda_available():
            kind = "plain"  # no CUDA: nothing to pin for; the same steps run on plain memory
        self.kind = kind
        if kind == "plain":
            self.array = np.empty(self.nbytes, np.uint8)
            return
        import torch

        if kind == "pinned":
            self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)  # CUDA: page-locked
        else:
            self._tensor = shared_empty((self.nbytes,), torch.uint8)
        self.array = self._tensor.numpy()

    @property
    def tensor(self) -> Any:
        """The buffer as a torch uint8 tensor (sharing its memory)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def carve(self, shapes: list[tuple[tuple[int, ...], Any]]) -> list[Any]:
        """Torch tensors of (shape, torch dtype), laid one after another (ALIGN-aligned)."""
        out, at = [], 0
        for shape, dtype in shapes:
            n = int(np.prod(shape)) * dtype.itemsize
            out.append(self.tensor[at : at + n].view(dtype).view(shape))
            at += carve_bytes([n])
        return out

    def carve_arrays(self, shapes: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Numpy arrays of (shape, dtype), laid out as `carve` lays them."""
        out, at = [], 0
        for shape, dtype in shapes:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out.append(self.array[at : at + n].view(dtype).reshape(shape))
            at += carve_bytes([n])
        return out


class Spare:
    """Free buffers kept for this process's next pool, up to `cap_bytes` in all."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = int(cap_bytes)
        self._bufs: list[HostBuffer] = []
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)

    def kept(self) -> list[HostBuffer]:
        """The buffers kept now (a snapshot)."""
        with self._lock:
            return list(self._bufs)

    def keep(self, buf: HostBuffer) -> bool:
        """Keep `buf` when it fits under the cap (else it is freed); whether it was kept."""
        with self._lock:
            if sum(b.nbytes for b in self._bufs) + buf.nbytes > self.cap_bytes:
                return False
            self._bufs.append(buf)
            return True

    def take(self, nbytes: int, kind: str) -> HostBuffer | None:
        """The smallest kept buffer of `kind` with at least `nbytes`, or None."""
        with self._lock:
            fits = [b for b in self._bufs if b.kind == kind and b.nbytes >= nbytes]
            if not fits:
                return None
            buf = min(fits, key=lambda b: b.nbytes)
            self._bufs.remove(buf)
            return buf


class SlotPool:
    """Up to `n` reusable buffers of one kind (see the module docstring).

    Args:
        n: buffers lent at once at most (may be raised later: `pool.n += k`).
        kind: "plain", "pinned" or "shared".
        spare: where a closed pool's free buffers go, and a new one's come from.
    """

    def __init__(self, n: int, kind: str = "plain", spare: Spare | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}. Got {kind!r}.")
        self.n, self.kind, self.spare = n, kind, spare
        self.made = 0
        self._free: list[HostBuffer] = []
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def take(self, nbytes: int) -> HostBuffer:
        """A free buffer of at least `nbytes`; waits while `n` are lent."""
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self._free:
                    buf = self._free.pop()
                    break
                if self.made < self.n:
                    self.made += 1
                    buf = None
                    break
                self._cond.wait()
        if buf is None:
            buf = self.spare.take(nbytes, self._made_kind()) if self.spare is not None else None
        if buf is None or buf.nbytes < nbytes:
            buf = HostBuffer(nbytes, self.kind)  # (a buffer too small is freed)
        return buf

    def give_back(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def fail(self, error: BaseException) -> None:
        """Wake every waiting `take` with `error` raised (and raise it in later ones)."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Keep the free buffers in the spare (up to its cap)."""
        with self._cond:
            free, self._free = self._free, []
        if self.spare is not None:
            for buf in free:
                self.spare.keep(buf)

    def _made_kind(self) -> str:
        return "plain" if self.kind == "pinned" and not _cuda_available() else self.kind


def shared_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised torch tensor in shared memory: a DataLoader sends it by handle, no copy."""
    import torch

    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
    except AttributeError:  # pragma: no cover - older torch
        return torch.empty(shape, dtype=dtype).share_memory_()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


_FREE_REFS: list[int | None] = []  # references of a storage only its tensor holds (found once)


def unreferenced(t: Any) -> bool:
    """True when no view of torch tensor `t` (a returned batch, a numpy array of it) is alive."""
    import torch

    def refs(x: Any) -> int:
        return torch._C._storage_Use_Count(x.untyped_storage()._cdata)

    if not _FREE_REFS:
        try:
            _FREE_REFS.append(refs(torch.empty(1)))
        except Exception:  # noqa: BLE001 - private API gone: never reuse a buffer
            _FREE_REFS.append(None)
    return _FREE_REFS[0] is not None and refs(t) == _FREE_REFS[0]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
