"""DeviceCopy: the one copy between host memory and a CUDA device, in each direction.

Each copy is issued non-blocking on a side stream, after the stream has waited for the
device's current stream (whatever made the source is done); `record_stream` keeps a
device tensor's memory from being reused while the side stream may still use it; an
event recorded after the copies tells when they have landed. Nothing here waits for the
GPU. On the CPU (no CUDA) the same calls run as host copies with an event that is done,
so that everything around them runs in the tests of a CPU-only torch. The CUDA-only
lines are marked `# CUDA`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _Done:
    """An event that has completed (the CPU's stand-in for a CUDA event)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = _Done()


class DeviceCopy:
    """Copies to and from `device` on one side stream (see the module docstring).

    Args:
        device: a torch.device; "cuda" copies asynchronously, anything else by host copies.
    """

    def __init__(self, device: Any):
        import torch

        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        self.pinned = self.cuda  # host buffers should be pinned for the copies to overlap
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # CUDA

    def to_host(self, src: Any, dst: Any) -> None:
        """dst[...] = src: a device tensor into (pinned) host memory, non-blocking."""
        if not self.cuda:
            dst.copy_(src)
            return
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # CUDA
        with torch.cuda.stream(self.stream):  # CUDA
            dst.copy_(src, non_blocking=True)  # CUDA
            src.record_stream(self.stream)  # CUDA: src's memory is not reused before the copy ran

    def to_device(
        self, tensors: list[Any], then: Callable[[list[Any]], list[Any]] | None = None
    ) -> tuple[list[Any], Any]:
        """(the host tensors on the device, the event after their copies): `then`, when
        given, runs on the side stream after the copies (a cast, say) and its result is
        returned. On the CPU: copies of the tensors (the source's memory may be reused)."""
        if not self.cuda:
            moved = [t.clone() for t in tensors]  # copy: the stand-in for the device copy
            return (then(moved) if then is not None else moved), DONE
        import torch

        with torch.cuda.stream(self.stream):  # CUDA
            moved = [t.to(self.device, non_blocking=True) for t in tensors]  # CUDA: from pinned memory
            if then is not None:
                moved = then(moved)
            event = torch.cuda.Event()  # CUDA
            event.record(self.stream)  # CUDA
        return moved, event

    def record(self) -> Any:
        """An event after every copy issued so far (DONE on the CPU)."""
        if not self.cuda:
            return DONE
        return self.stream.record_event()  # CUDA

    def synchronize(self) -> None:
        """Wait until every copy issued has run."""
        if self.cuda:
            self.stream.synchronize()  # CUDA


def hand_over(tensors: list[Any], event: Any) -> None:
    """Make device tensors copied by a DeviceCopy safe for the calling thread's current
    stream: it waits for `event`, and their memory is not reused while it may use them."""
    if event is DONE:
        return
    import torch

    streams: dict[Any, Any] = {}
    for t in tensors:
        if not t.is_cuda:
            continue
        current = streams.get(t.device)
        if current is None:
            current = streams[t.device] = torch.cuda.current_stream(t.device)  # CUDA
            current.wait_event(event)  # CUDA
        t.record_stream(current)  # CUDA
