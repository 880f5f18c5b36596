"""A writer's rank and world size from the launcher's environment (Slurm arrays, srun, torchrun).

`actstore write` without --rank takes them from, in this order of precedence:
SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (a job array: one task per rank; task ids
counted from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP), SLURM_PROCID /
SLURM_NTASKS (srun tasks), RANK / WORLD_SIZE (torchrun, torch.distributed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actstore.errors import CaptureError
from actstore.layout import spec


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    source: str  # where they came from, as printed at start


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """The partition contract: the contiguous slice [start, stop) of n examples that writer
    `rank` of `world` takes (into shard `rank`)."""
    return n * rank // world, n * (rank + 1) // world


def bar_total(o: Any, n: int) -> int | None:
    """The total of a job's one progress bar: the examples its `o.workers` writers have left
    of `n` (those committed before a --resume are done), or None for --pack/--chunk, whose
    windows the writers count themselves."""
    if o.pack or o.chunk:
        return None
    if not o.resume:
        return n
    from actstore.capture.target import CaptureTarget

    return max(n - CaptureTarget.of(o.store).committed_total(range(o.workers)), 0)


def _int(env: Mapping[str, str], name: str) -> int:
    v = env[name]
    try:
        return int(v)
    except ValueError:
        raise CaptureError(
            f"environment variable {name}={v!r} is not an integer; fix the launcher or pass --rank/--world-size"
        ) from None


def from_env(env: Mapping[str, str]) -> Rank | None:
    """The rank the environment gives, or None when no launcher variables are set."""
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" not in env:
        raise CaptureError(
            f"SLURM_ARRAY_TASK_ID={env['SLURM_ARRAY_TASK_ID']} is set but SLURM_ARRAY_TASK_COUNT is not (an old Slurm, or a "
            "variable set by hand): this task cannot know its share of the data; pass --rank/--world-size"
        )
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
        first = _int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        step = _int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
        if step < 1 or (task - first) % step:
            raise CaptureError(
                f"SLURM_ARRAY_TASK_ID={task} is not on the array's grid (min {first}, step {step}); "
                "use a contiguous array such as --array=0-N, or pass --rank/--world-size"
            )
        found = Rank((task - first) // step, count, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = Rank(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), "SLURM_PROCID/SLURM_NTASKS")
    elif "RANK" in env and "WORLD_SIZE" in env:
        found = Rank(_int(env, "RANK"), _int(env, "WORLD_SIZE"), "RANK/WORLD_SIZE")
    else:
        return None
    check(found.rank, found.world_size, f" (from {found.source})")
    return found


def check(rank: int, world: int, where: str = "") -> None:
    if not 1 <= world <= spec.MAX_WORLD_SIZE:
        raise CaptureError(f"world size must be in 1..{spec.MAX_WORLD_SIZE}{where}. Got {world}.")
    if not 0 <= rank < world:
        raise CaptureError(f"rank must be in 0..{world - 1} for a world size of {world}{where}. Got {rank}.")


def resolve(rank: int | None, world: int | None, env: Mapping[str, str]) -> Rank:
    """--rank/--world-size when given (both or neither), else the environment's, else 0 of 1."""
    if (rank is None) != (world is None):
        raise CaptureError("give --rank and --world-size together (or neither, to take them from Slurm or torchrun)")
    if rank is not None and world is not None:
        check(rank, world)
        return Rank(rank, world, "--rank/--world-size")
    return from_env(env) or Rank(0, 1, "default (one writer)")
