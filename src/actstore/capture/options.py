"""CaptureOptions: every setting of a capture, one frozen value from the CLI to the writer.

`actstore write` builds one from its options (field = option: `batch_size` is
`--batch-size`), `actstore.record` from its keywords; `check` rejects contradictory
settings before anything is loaded or written, naming them as the caller spelled them
(`--writer-nice` on the command line, `writer_nice` in Python). The writer's own part
travels on as `writer_options()` (actstore.write.options.WriterOptions).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from actstore.devices import parse_device
from actstore.errors import CaptureError
from actstore.layout import spec
from actstore.write.options import MAX_THREADS

RUNNERS = ("local", "ray")
SPECIAL = ("keep", "mask", "drop")  # special and template tokens: stored as content, labelled, left out
DROPPABLE = ("bos", "cls")  # --drop (deprecated): tokens the model sees but the store leaves out
DEFAULT_QUEUE = 4
DEFAULT_WRITER_NICE = 10  # the writer threads' priority drop (Linux nice, per thread)


def default_writer_threads() -> int:
    """Threads that write (or upload) shard files: half the cores, 2..8 (the other half
    converts, checksums and runs the model's host side)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """Every setting of a capture (`actstore write --help` describes each option).

    record() reads the fields from `layers` to `gpus_per_worker`; `actstore write` (the
    job from a model name and a data path) reads them all.
    """

    # -- what is recorded --
    layers: tuple[int | str, ...] = ()
    dtype: str = spec.DEFAULT_DTYPE
    stats: bool = True
    on_overflow: str = "raise"
    special: str = "mask"
    drop: tuple[str, ...] = ()  # deprecated spelling (--drop bos|cls), kept one release
    token_ids: bool | None = None  # None: when the batches carry input_ids
    # -- the store's layout and commits --
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT
    shard_examples: int | str | None = spec.SHARD_EXAMPLES_AUTO
    commit_bytes: int = spec.DEFAULT_COMMIT_BYTES
    fsync: bool = False
    resume: bool = False
    # -- the pipeline --
    queue_size: int = DEFAULT_QUEUE
    writer_threads: int | None = None  # None: default_writer_threads()
    writer_nice: int = DEFAULT_WRITER_NICE
    stop_early: bool = True
    # -- who writes: ranks and runners --
    rank: int | None = None  # None (with world_size None): from Slurm/torchrun variables, else 0 of 1
    world_size: int | None = None
    runner: str = "local"  # "local": processes on this machine; "ray": actors on a Ray cluster
    workers: int = 1
    ray_address: str | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    # -- actstore write's job: the model and the data --
    store: str | None = None
    model: str | None = None
    data: str | None = None
    batch_size: int = 8
    device: str = "cpu"
    model_dtype: str = "float32"
    threads: int | None = None
    max_examples: int | None = None
    text_field: str | None = None
    encoding: str = "utf-8"
    errors: str = "strict"
    # -- texts: budgets, prompts and responses --
    p_max: int | None = None
    r_max: int | None = None
    p_quantile: float | None = None
    r_quantile: float | None = None
    separator: str = "\n"
    bos: str = "auto"  # token 0 of a text or prompt: spec.BOS_MODES (actstore.inputs.prepare.choose_bos)
    chat_template: bool = False
    system: str | None = None  # None: the template's own default; "": no system prompt
    generate: int = 0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    # -- corpora in windows --
    pack: bool = False
    chunk: bool = False
    context: int | None = None
    window_bos: bool = True
    # -- the end of the job --
    finalize: bool = True
    progress: bool = True

    @property
    def drop_cls(self) -> bool:
        """Image stores leave out token 0 (a ViT's CLS): --special drop (or --drop cls)."""
        return "cls" in self.drop

    @property
    def drop_bos(self) -> bool:
        return "bos" in self.drop

    @property
    def sampling(self) -> dict[str, Any] | None:
        """--generate's settings as recorded in the store's attrs (None without --generate)."""
        if not self.generate:
            return None
        return {
            "max_new_tokens": self.generate,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def writer_options(self, world_size: int | None) -> dict[str, Any]:
        """The ShardWriter options this capture sets (actstore.write.options.WriterOptions fields)."""
        return {
            "resume": self.resume,
            "on_overflow": self.on_overflow,
            "stats": self.stats,
            "fsync": self.fsync,
            "world_size": world_size,
            "io_threads": self.writer_threads or default_writer_threads(),
        }

    def check(self, names: str = "python") -> None:
        """Reject contradictory settings; `names` "cli" spells them as options (--batch-size)."""
        n = (lambda f: "--" + f.replace("_", "-")) if names == "cli" else (lambda f: f)
        _check_ints(self, n)
        if self.runner not in RUNNERS:
            raise CaptureError(f"{n('runner')} must be one of {list(RUNNERS)}. Got {self.runner!r}.")
        if self.special not in SPECIAL:
            raise CaptureError(f"{n('special')} must be one of {list(SPECIAL)}. Got {self.special!r}.")
        if self.bos not in spec.BOS_MODES:
            raise CaptureError(f"{n('bos')} must be one of {list(spec.BOS_MODES)}. Got {self.bos!r}.")
        if self.on_overflow not in ("raise", "clip"):
            raise CaptureError(f"{n('on_overflow')} must be one of ['raise', 'clip']. Got {self.on_overflow!r}.")
        if self.dtype not in spec.ACT_DTYPES:
            raise CaptureError(f"{n('dtype')} must be one of {list(spec.ACT_DTYPES)}. Got {self.dtype!r}.")
        unknown = [d for d in self.drop if d not in DROPPABLE]
        if unknown:
            raise CaptureError(f"--drop takes {list(DROPPABLE)}. Got {unknown}.")
        if self.zarr_format not in spec.ZARR_FORMATS:
            raise CaptureError(f"{n('zarr_format')} must be one of {list(spec.ZARR_FORMATS)}. Got {self.zarr_format}.")
        if self.shard_examples not in (spec.SHARD_EXAMPLES_AUTO, None):
            if not _int(self.shard_examples) or self.shard_examples < 1:
                raise CaptureError(f"{n('shard_examples')} must be a positive int. Got {self.shard_examples}.")
            if self.zarr_format != 3:
                raise CaptureError(f"{n('shard_examples')} (Zarr sharding) needs {n('zarr_format')} 3")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0:
            raise CaptureError(
                f"{n('cpus_per_worker')} must be positive and {n('gpus_per_worker')} non-negative. "
                f"Got {self.cpus_per_worker}, {self.gpus_per_worker}."
            )
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise CaptureError(
                f"{n('temperature')} must be a finite number >= 0 (0: greedy). Got {self.temperature!r}."
            )
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise CaptureError(f"{n('top_p')} must be a number in (0, 1] (1: no nucleus cut). Got {self.top_p!r}.")
        if (self.temperature or self.top_p != 1.0) and not self.generate:
            raise CaptureError(f"{n('temperature')} and {n('top_p')} sample the responses of {n('generate')} N")
        if self.system is not None and not self.chat_template:
            raise CaptureError(
                f"{n('system')} sets the system prompt of {n('chat_template')}; add {n('chat_template')}"
            )


_POSITIVE = ("batch_size", "workers", "queue_size", "commit_bytes")
_OPTIONAL_POSITIVE = ("writer_threads", "threads", "max_examples", "p_max", "r_max", "context")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_ints(o: CaptureOptions, n: Any) -> None:
    if not _int(o.writer_nice) or not 0 <= o.writer_nice <= 19:
        raise ValueError(f"{n('writer_nice')} must be an int in 0..19. Got {o.writer_nice!r}.")
    for f in _POSITIVE:
        v = getattr(o, f)
        if not _int(v) or v < 1:
            raise CaptureError(f"{n(f)} must be a positive int. Got {v!r}.")
    for f in _OPTIONAL_POSITIVE:
        v = getattr(o, f)
        if v is not None and (not _int(v) or v < 1):
            raise CaptureError(f"{n(f)} must be a positive int. Got {v!r}.")
    if o.writer_threads is not None and o.writer_threads > MAX_THREADS:
        raise CaptureError(
            f"{n('writer_threads')} must be an int in 1..{MAX_THREADS} (threads beyond the cores only take memory). "
            f"Got {o.writer_threads!r}."
        )
    if not _int(o.generate) or o.generate < 0:
        raise CaptureError(f"{n('generate')} must be a non-negative int. Got {o.generate!r}.")


FIELDS = tuple(f.name for f in fields(CaptureOptions))


def make_options(options: CaptureOptions | None, given: dict[str, Any]) -> CaptureOptions:
    """`options` with the keywords `given` (CaptureOptions fields) set over it."""
    from dataclasses import replace

    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown capture options {unknown}; CaptureOptions has {list(FIELDS)}")
    if options is None:
        return CaptureOptions(**given)
    if not isinstance(options, CaptureOptions):
        raise TypeError(f"options must be a CaptureOptions. Got {type(options).__name__}.")
    return replace(options, **given)


def check_job(o: CaptureOptions) -> None:
    """`actstore write`'s checks beyond `check`: the model, the data, their windows and budgets."""
    from actstore.capture import ranks

    o.check(names="cli")
    parse_device(o.device, name="--device", visible=o.runner == "local")  # the workers' devices are theirs to check
    if (o.workers > 1 or o.runner == "ray") and (o.rank is not None or o.world_size is not None):
        raise CaptureError(
            "use either --workers N (writers started by actstore) or --rank/--world-size (one writer per launch), not both"
        )
    if o.rank is not None or o.world_size is not None:
        ranks.resolve(o.rank, o.world_size, {})
    if o.runner != "ray" and (o.gpus_per_worker or o.ray_address):
        raise CaptureError("--gpus-per-worker and --ray-address go with --runner ray")
    if o.pack and o.chunk:
        raise CaptureError(
            "give --pack (documents concatenated into windows) or --chunk (each document cut into windows), not both"
        )
    if (o.pack or o.chunk) != (o.context is not None):
        raise CaptureError(
            "--pack and --chunk need --context N (the window length in tokens), and --context needs one of them"
        )
    if (o.pack or o.chunk) and (o.generate or o.chat_template or o.p_max or o.r_max or o.p_quantile or o.r_quantile):
        raise CaptureError(
            "--pack/--chunk store every token of the corpus in windows of --context tokens: "
            "--p-max, --r-max, quantiles, --generate and --chat-template do not apply"
        )
    if (o.pack or o.chunk) and o.bos != "auto":
        raise CaptureError(
            f"--bos {o.bos} sets token 0 of each text or prompt; --pack/--chunk windows start with the tokenizer's BOS "
            "(--no-window-bos leaves it out)"
        )
    if o.p_max is not None and o.p_quantile is not None:
        raise CaptureError("give --p-max or --p-quantile, not both")
    if o.r_max is not None and o.r_quantile is not None:
        raise CaptureError("give --r-max or --r-quantile, not both")
    for name, q in (("--p-quantile", o.p_quantile), ("--r-quantile", o.r_quantile)):
        if q is not None and not 0 < q <= 1:
            raise CaptureError(f"{name} must be in (0, 1], e.g. 0.99. Got {q}.")
    if o.generate and o.r_quantile is not None:
        raise CaptureError(
            "--r-quantile needs responses in the data; with --generate N the response budget is N (or --r-max)"
        )
