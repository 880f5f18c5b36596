"""The capture loop of one shard: forward passes on this thread, the writer on its own.

Per batch: the batch is moved to the model's device, the forward pass runs with the hooks,
and each hooked output goes through the device stage as its module fires (gather, cast,
statistics, one copy into a ring slot: actstore.capture.stage). The staged batch goes to
the writer thread (a bounded queue: actstore.capture.drain), which appends and commits it
(actstore.capture.writeside) while the next forward pass runs. The first batch's outputs set the
store's configuration; the writer thread opens the shard meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from actstore.capture.drain import Drain
from actstore.capture.hooks import Capture
from actstore.capture.record_inputs import accepts, as_batch, device_of
from actstore.capture.stage import Stage
from actstore.capture.writeside import Job, WriteSide
from actstore.errors import EmptyDatasetError
from actstore.storage import retry
from actstore.write.pipeline import IOStats


@dataclass(frozen=True)
class RecordResult:
    """What one record() call did.

    Attributes:
        shard: the shard written.
        n_before: examples already committed when the run started (resume).
        n_written: examples written by this run.
        tokens: token vectors stored per layer by this run.
        nbytes: activation bytes written by this run.
        seconds: wall time of the run.
        forward_seconds: time spent in forward passes (with the device stage) and input preparation.
        wait_seconds: time the forward loop waited for the writer (queue full).
        writer_seconds: time the writer thread spent appending and committing.
        writer_cpu_seconds: CPU time of that thread (what it takes from the model's cores;
            the rest of writer_seconds is waiting: on the device's copies, the statistics
            threads or the disk).
        source_tokens: tokens the data held for what was stored (before truncation; text segments).
        truncated_tokens: of those, the tokens cut by the segments' budgets.
        network: the object-store connection failures and retries of this run, by kind
            (actstore.storage.retry.counts).
    """

    shard: int
    n_before: int
    n_written: int
    tokens: int
    nbytes: int
    seconds: float
    forward_seconds: float
    wait_seconds: float
    writer_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    source_tokens: int = 0
    truncated_tokens: int = 0
    network: dict[str, int] = field(default_factory=dict)


def run(
    job: Job,
    batches: Iterable[Any],
    progress: Callable[[int, int, int], None] | None = None,
    io_progress: Callable[[IOStats], None] | None = None,
) -> RecordResult:
    """Record `batches` into the job's shard; the shard is closed (complete) at the end."""
    lm, opts = job.lm, job.opts
    device = device_of(lm.forward)
    extra = {"use_cache": False} if accepts(lm.forward, "use_cache") else {}
    side = WriteSide(job, progress, io_progress)
    drain: Drain | None = None

    def start_writer(cfg: Any) -> None:  # the writer thread opens the shard while the first forward runs on
        nonlocal drain
        drain = Drain(
            side.write, opts.queue_size, start=lambda: side.open(cfg), nice=opts.writer_nice, on_error=stage.ring.fail
        )

    stage = Stage(job, device, start_writer)
    t0 = time.perf_counter()
    net0 = retry.counts()
    t_fwd = 0.0
    try:
        with Capture(lm.forward, job.hooks, stop_early=opts.stop_early, on_output=stage.take) as cap:
            it = iter(batches)
            while True:
                t1 = time.perf_counter()
                try:
                    raw = next(it)
                except StopIteration:
                    break
                batch = as_batch(raw, lm.forward, device)
                if stage.cfg is None and opts.token_ids is None:
                    job.token_ids = job.target.keeps_token_ids("input_ids" in batch.inputs)
                stage.begin(batch)
                cap.run({**batch.inputs, **extra}, batch.args)
                staged = stage.finish()
                t_fwd += time.perf_counter() - t1
                drain.put(staged)
        if drain is None:
            return _nothing_to_record(job, t0, net0)
        drain.close()
        side.close()
    except BaseException:
        stage.abort()
        if drain is not None:
            drain.abort()
        side.abandon()
        raise
    finally:
        stage.close()
    return RecordResult(
        shard=job.shard,
        n_before=side.n_before,
        n_written=side.n_written,
        tokens=side.tokens,
        nbytes=side.nbytes,
        seconds=time.perf_counter() - t0,
        forward_seconds=t_fwd,
        wait_seconds=drain.wait_seconds,
        writer_seconds=drain.busy_seconds,
        writer_cpu_seconds=drain.cpu_seconds,
        source_tokens=side.source_tokens,
        truncated_tokens=side.truncated_tokens,
        network=retry.counts_since(net0),
    )


def _nothing_to_record(job: Job, t0: float, net0: Any) -> RecordResult:
    """No batches: a resumed shard whose examples were all committed is closed; else an error."""
    from actstore.write import ShardWriter
    from actstore.write.options import WriterOptions

    n0, complete = job.target.committed(job.shard)
    if not (job.opts.resume and (n0 or complete)):
        raise EmptyDatasetError("no batches to record: the data is empty (nothing was written)")
    if not complete:  # reopened with the store's own identity, to close it
        lease = job.target.lease(job.shard)  # taken before the model loaded, if it was
        ShardWriter(
            job.target.root,
            shard=job.shard,
            config=job.target.identity(),
            options=WriterOptions(resume=True, stats=job.opts.stats),
            lease=lease,
        ).close()
    return RecordResult(
        shard=job.shard,
        n_before=n0,
        n_written=0,
        tokens=0,
        nbytes=0,
        seconds=time.perf_counter() - t0,
        forward_seconds=0.0,
        wait_seconds=0.0,
        network=retry.counts_since(net0),
    )
