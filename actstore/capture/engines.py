"""`actstore write --engine ray`: one writer actor per worker on a Ray cluster.

Writer r of w takes the same slice of the data as `--rank r --world-size w` and writes
shard r. The cluster is the one at --ray-address or RAY_ADDRESS, else a local one started
here (and stopped at the end). An actor that dies (killed, node lost) is restarted by Ray
and resumes its shard after the last commit: its lease is taken over once its process is
gone (same node) or its TTL ran out (another node). Progress of every actor feeds one bar
in the driver; the driver finalizes once all are done.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from actstore.capture.errors import CaptureError
from actstore.capture.record import RecordResult

MAX_RESTARTS = 3  # per actor: a writer killed more often than this fails the job


def _connect(o: Any) -> bool:
    """Join the cluster (or start a local one); True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = o.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if address and address != "local":
        _check_reachable(address)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
    else:
        # A private local cluster: keep every socket on loopback (Ray otherwise binds the
        # host's routable address) and start no dashboard.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.update(env)
        cpus = max(int(o.cpus_per_worker * o.workers + 0.999), os.cpu_count() or 1)
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
    """A Ray actor: writes one rank's shard (a retried call after a restart resumes it).
    Constructed without arguments: Ray restarts such an actor without the object store."""

    def run(self, run_shard: Callable[..., RecordResult], o: Any, rank: int, world: int, queue: Any) -> RecordResult:
        from actstore.errors import ShardBusyError

        self.queue = queue
        deadline = None
        while True:
            try:
                return run_shard(o, rank, world, progress=self)
            except ShardBusyError:
                # A restart on another node finds the dead actor's lease: it expires unless renewed.
                from actstore.write.lease import lease_ttl

                deadline = deadline or time.monotonic() + 2 * lease_ttl()
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def update(self, examples: int, tokens: int, nbytes: int) -> None:
        self.queue.put_nowait(("progress", examples, tokens, nbytes))


def run_ray(o: Any, n: int, run_shard: Callable[..., RecordResult]) -> list[RecordResult]:
    """Write shards 0..o.workers-1 with Ray actors, each calling `run_shard(o, rank, world,
    progress=...)` (actstore.capture.run); returns their results in rank order."""
    try:
        import ray
        from ray.util.queue import Empty, Queue
    except ImportError:
        raise CaptureError("--engine ray needs Ray: pip install 'actstore[ray]'") from None
    from actstore.capture.data import absolute_data
    from actstore.capture.progress import Progress
    from actstore.capture.ranks import split
    from actstore.capture.record import committed

    data = absolute_data(o.data)  # actors run elsewhere (globs too)
    store = os.path.abspath(o.store) if "://" not in str(o.store) else o.store
    # The driver checked that a fresh run starts on no shard: a restarted actor resumes.
    wo = replace(o, data=data, store=store, resume=True, progress=False, threads=o.threads or max(1, int(o.cpus_per_worker)))
    started = _connect(o)
    try:
        queue = Queue(actor_options={"num_cpus": 0})
        actor = ray.remote(num_cpus=o.cpus_per_worker, num_gpus=o.gpus_per_worker, max_restarts=MAX_RESTARTS,
                           max_task_retries=MAX_RESTARTS)(_Writer)
        writers = [actor.options(name=f"actstore-writer-{r}-{os.getpid()}").remote() for r in range(o.workers)]
        pending = {w.run.remote(run_shard, wo, r, o.workers, queue): r for r, w in enumerate(writers)}
        todo = sum(split(n, o.workers, r)[1] - split(n, o.workers, r)[0] for r in range(o.workers))
        done = sum(committed(store, r)[0] for r in range(o.workers)) if o.resume else 0
        if o.progress:
            print(f"{o.workers} Ray writer actors (each loads {o.model}) ...", file=sys.stderr, flush=True)
        bar = Progress(total=max(todo - done, 0), desc=f"{o.workers} ray writers", disable=not o.progress)
        results: dict[int, RecordResult] = {}
        errors: dict[int, str] = {}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    r = pending.pop(ref)
                    try:
                        results[r] = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - one line per failed writer
                        cause = getattr(e, "cause", None) or e
                        errors[r] = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
                _drain(queue, bar, Empty)
            _drain(queue, bar, Empty)
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
    return [results[r] for r in range(o.workers)]


def _drain(queue: Any, bar: Any, empty: type[Exception]) -> None:
    while True:
        try:
            msg = queue.get_nowait()
        except empty:
            return
        bar.update(*msg[1:])
