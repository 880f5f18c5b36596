"""Writers on a Ray cluster: `actstore write --runner ray` and `record(..., runner="ray")`.

One writer actor per rank. Writer r of w takes the same slice as `--rank r --world-size w`
(the data's examples for `actstore write`; the list of batches for `record`) and writes
shard r. The cluster is the one at --ray-address or RAY_ADDRESS, else a private local one
started here (and stopped at the end). An actor that dies (killed, node lost) is restarted
by Ray and its call retried: it resumes its shard after the last commit, taking the dead
writer's lease over once its process is gone (same node) or its TTL ran out (another node).
Progress of every actor feeds one bar in the driver.

This module does not import the writers: `actstore write` passes its run_shard and
`record` passes itself (so that nothing here imports back up).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from actstore.errors import CaptureError

MAX_RESTARTS = 3  # per actor: a writer killed more often than this fails the job


@dataclass(frozen=True)
class RaySettings:
    """Where and how the writer actors run."""

    workers: int
    address: str | None = None  # None: RAY_ADDRESS, else a private local cluster
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    progress: bool = True


def _connect(s: RaySettings) -> bool:
    """Join the cluster (or start a local one); True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = s.address or os.environ.get("RAY_ADDRESS")
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if address and address != "local":
        _check_reachable(address)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
    else:
        # A private local cluster: keep every socket on loopback (Ray otherwise binds the
        # host's routable address) and start no dashboard.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.update(env)
        cpus = max(int(s.cpus_per_worker * s.workers + 0.999), os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return True


def _check_reachable(address: str) -> None:
    """A driver pointed at a cluster that is not up hangs for minutes: look first."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise CaptureError(
            f"no Ray cluster answers at {address} ({e}); start one (`ray start --head`) or fix --ray-address / RAY_ADDRESS"
        ) from None


class _Writer:
    """A Ray actor: runs one rank's job (a retried call after a restart resumes the shard).
    Constructed without arguments: Ray restarts such an actor without the object store."""

    def run(self, job: Callable[..., Any], queue: Any, rank: int = 0) -> Any:
        from actstore.errors import ShardBusyError

        self.queue = queue
        self.rank = rank
        deadline = None
        while True:
            try:
                return job(progress=self)
            except ShardBusyError:
                # A restart on another node finds the dead actor's lease: it expires unless renewed.
                from actstore.write.lease import lease_ttl

                deadline = deadline or time.monotonic() + 2 * lease_ttl()
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.queue.put_nowait(("progress", examples, tokens, nbytes))

    def io(self, stats: Any) -> None:
        self.queue.put_nowait(("io", self.rank, stats))


def run_actors(
    jobs: Sequence[Callable[..., Any]],
    s: RaySettings,
    *,
    total: int | None,
    desc: str,
    callback: Callable[[int, int, int], None] | None = None,
) -> list[Any]:
    """Run jobs[r] (called with `progress=` an object with `update(examples, tokens, bytes)`)
    in writer actor r; returns their results in rank order, or raises naming each failed writer.
    Progress goes to one bar in the driver (s.progress) and to `callback`."""
    try:
        import ray
        from ray.util.queue import Empty, Queue
    except ImportError:
        raise CaptureError("the Ray runner needs Ray: pip install 'actstore[ray]'") from None
    from actstore.capture.capture_bar import CaptureBar

    started = _connect(s)
    try:
        queue = Queue(actor_options={"num_cpus": 0})
        actor = ray.remote(
            num_cpus=s.cpus_per_worker,
            num_gpus=s.gpus_per_worker,
            max_restarts=MAX_RESTARTS,
            max_task_retries=MAX_RESTARTS,
        )(_Writer)
        writers = [actor.options(name=f"actstore-writer-{r}-{os.getpid()}").remote() for r in range(len(jobs))]
        pending = {w.run.remote(job, queue, r): r for r, (w, job) in enumerate(zip(writers, jobs))}
        bar = CaptureBar(total=total, desc=desc, disable=not s.progress)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    r = pending.pop(ref)
                    try:
                        results[r] = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - one line per failed writer
                        errors[r] = _one_line(getattr(e, "cause", None) or e)
                _drain(queue, bar, Empty, callback)
            _drain(queue, bar, Empty, callback)
        finally:
            bar.close()
            for w in writers:
                ray.kill(w)
            ray.kill(queue.actor)
    finally:
        if started:
            ray.shutdown()
    if errors:
        raise CaptureError("; ".join(f"writer {r}: {m} (rerun with --resume)" for r, m in sorted(errors.items())))
    return [results[r] for r in range(len(jobs))]


def _one_line(e: BaseException) -> str:
    """A failed writer in one line: actstore's own message, else the exception's type and first line."""
    from actstore.errors import ActstoreError

    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    if isinstance(e, (ActstoreError, CaptureError)) and lines:
        return lines[0]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _drain(queue: Any, bar: Any, empty: type[Exception], callback: Callable[[int, int, int], None] | None) -> None:
    while True:
        try:
            msg = queue.get_nowait()
        except empty:
            return
        if msg[0] == "io":
            bar.io(msg[2], who=msg[1])
            continue
        bar.update(*msg[1:])
        if callback is not None:
            callback(*msg[1:])


# ---- actstore write --runner ray ------------------------------------------------------
def run_ray(o: Any, n: int, run_shard: Callable[..., Any]) -> list[Any]:
    """Write shards 0..o.workers-1 of n examples (documents with --pack / --chunk) with Ray actors, each calling
    `run_shard(o, rank, world, progress=...)` (actstore.capture.run)."""
    from actstore.capture.ranks import bar_total
    from actstore.inputs.data import absolute_data

    store = os.path.abspath(o.store) if "://" not in str(o.store) else o.store
    # The driver checked that a fresh run starts on no shard: a restarted actor resumes.
    wo = replace(
        o,
        data=absolute_data(o.data),
        store=store,
        resume=True,
        progress=False,  # actors run elsewhere
        threads=o.threads or max(1, int(o.cpus_per_worker)),
    )
    total = bar_total(o, n)
    if o.progress:
        print(f"{o.workers} Ray writer actors (each loads {o.model}) ...", file=sys.stderr, flush=True)
    settings = RaySettings(
        workers=o.workers,
        address=o.ray_address,
        cpus_per_worker=o.cpus_per_worker,
        gpus_per_worker=o.gpus_per_worker,
        progress=o.progress,
    )
    jobs = [functools.partial(run_shard, wo, r, o.workers) for r in range(o.workers)]
    return run_actors(jobs, settings, total=total, desc=f"{o.workers} ray writers")


# ---- record(..., runner="ray") --------------------------------------------------------
def record_ray(
    record: Callable[..., Any],
    model: Any,
    batches: Any,
    store: str | os.PathLike,
    s: RaySettings,
    opts: Any,
    contents: Any,
    model_id: str | None,
    *,
    callback: Callable[[int, int, int], None] | None = None,
) -> list[Any]:
    """record() with `s.workers` writer actors: writer r records the contiguous slice r of
    `batches` (a sequence) into shard r. `model` is a model spec for load_model (a folder, a
    hub id, `embedded:...`), a picklable callable that returns the model, or a model (sent
    to every actor). `opts` (a CaptureOptions), `contents` (what the shard holds beside its layers: a
    writeside.ShardContents) and `model_id` go to each actor's record().
    Returns each writer's RecordResult in rank order (for a shard that was already
    complete, its count of committed examples); finalize afterwards."""
    from actstore.capture.ranks import split
    from actstore.capture.target import CaptureTarget

    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes)):
        raise CaptureError(
            f"record(runner='ray') splits `batches` across writers: pass a list of batches, not a {type(batches).__name__}"
        )
    if not 1 <= s.workers <= len(batches):
        raise CaptureError(
            f"record(runner='ray') needs 1..{len(batches)} workers for {len(batches)} batches. Got {s.workers}."
        )
    root = str(store) if "://" in str(store) else os.path.abspath(store)
    target = CaptureTarget(root)
    target.storage.check_access(write=True)
    if not opts.resume:
        target.check_fresh(range(s.workers), resume="resume=True")
    jobs = []
    for r in range(s.workers):
        a, b = split(len(batches), s.workers, r)
        jobs.append(
            functools.partial(
                _record_rank, record, model, list(batches[a:b]), root, r, s.workers, opts, contents, model_id
            )
        )
    return run_actors(jobs, s, total=None, desc=f"{s.workers} ray writers", callback=callback)


def _record_rank(
    record: Callable[..., Any],
    model: Any,
    batches: list[Any],
    store: str,
    rank: int,
    world: int,
    opts: Any,
    contents: Any,
    model_id: str | None,
    progress: Any,
) -> Any:
    """One actor's record(): the batches after the shard's committed examples (commits fall
    on batch boundaries); the shard's committed examples, loading no model, when it is complete."""
    from actstore.capture.target import CaptureTarget

    n_done, complete = CaptureTarget(store).committed(rank)
    if complete:
        return n_done
    skip, seen = 0, 0
    while seen < n_done and skip < len(batches):
        seen += _batch_size(batches[skip])
        skip += 1
    if seen != n_done:
        raise CaptureError(
            f"shard {rank} of {store} holds {n_done} committed examples, which do not end on a batch of its slice: "
            "resume it with the batches it was written from"
        )
    if isinstance(model, str) or (callable(model) and not hasattr(model, "forward")):
        from actstore.inputs.models import load_model

        model = load_model(model) if isinstance(model, str) else model()
    return record(
        model,
        batches[skip:],
        store,
        replace(opts, world_size=world, resume=True),
        shard=rank,
        segments=contents.segments,
        t_chunk=contents.t_chunk,
        token_labels=contents.token_labels,
        texts=contents.texts,
        model_id=model_id,
        attrs=contents.attrs,
        progress=progress.update,
        io_progress=getattr(progress, "io", None),
    )


def _batch_size(batch: Any) -> int:
    """Examples in a batch as record() takes them: a CaptureBatch, a dict of tensors, a tensor."""
    if isinstance(batch, dict):
        return int(next(iter(batch.values())).shape[0])
    if hasattr(batch, "inputs"):  # a CaptureBatch
        if batch.keys:
            return len(batch.keys)
        return int((next(iter(batch.inputs.values())) if batch.inputs else batch.args[0]).shape[0])
    return int(batch.shape[0])
