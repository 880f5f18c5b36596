"""WriteOptions: everything `actstore write` takes, and the checks that reject contradictory
options before anything is loaded or written."""

from __future__ import annotations

from dataclasses import dataclass

from actstore.capture import ranks
from actstore.inputs.prepare import SPECIAL_MODES
from actstore.capture.record import DEFAULT_WRITER_NICE
from actstore.errors import CaptureError
from actstore.layout import spec

ENGINES = ("local", "ray")
DROPPABLE = ("bos", "cls")


@dataclass(frozen=True)
class WriteOptions:
    """Everything `actstore write` takes (see `actstore write --help`)."""

    store: str
    model: str
    data: str
    layers: tuple[int | str, ...]
    dtype: str = spec.DEFAULT_DTYPE
    batch_size: int = 8
    device: str = "cpu"
    model_dtype: str = "float32"
    max_examples: int | None = None
    p_max: int | None = None
    r_max: int | None = None
    p_quantile: float | None = None
    r_quantile: float | None = None
    generate: int = 0
    special: str = "mask"
    chat_template: bool = False
    workers: int = 1
    rank: int | None = None  # None (with world_size None): from Slurm/torchrun variables, else 0 of 1
    world_size: int | None = None
    engine: str = "local"  # "local": --workers processes on this machine; "ray": actors on a Ray cluster
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    ray_address: str | None = None
    pack: bool = False  # concatenate the documents into windows of exactly `context` tokens
    chunk: bool = False  # cut each document into consecutive windows of at most `context` tokens
    context: int | None = None
    encoding: str = "utf-8"  # text files' encoding
    errors: str = "strict"  # undecodable documents: strict (fail), replace (U+FFFD), skip (leave out)
    window_bos: bool = True  # --pack / --chunk: each window starts with the tokenizer's BOS (labelled special)
    text_field: str | None = None  # the column / JSON key of each document's text
    drop: tuple[str, ...] = ()  # tokens the model sees but the store does not keep: "bos" (texts), "cls" (images)
    separator: str = "\n"  # pairs without a chat template: between prompt and response
    resume: bool = False
    finalize: bool = True
    commit_mb: float = spec.DEFAULT_COMMIT_BYTES / 2**20
    on_overflow: str = "raise"
    queue_size: int = 4
    stats: bool = True
    progress: bool = True
    threads: int | None = None
    zarr_format: int = spec.DEFAULT_ZARR_FORMAT
    shard_examples: int | str = spec.SHARD_EXAMPLES_AUTO  # with format 3: about 256 MiB a Zarr shard file
    writer_nice: int = DEFAULT_WRITER_NICE


def check_options(o: WriteOptions) -> None:
    """Reject contradictory options before anything is loaded or written."""
    if o.batch_size < 1:
        raise CaptureError(f"--batch-size must be a positive int. Got {o.batch_size}.")
    if o.workers < 1:
        raise CaptureError(f"--workers must be a positive int. Got {o.workers}.")
    if o.engine not in ENGINES:
        raise CaptureError(f"--engine must be one of {list(ENGINES)}. Got {o.engine!r}.")
    if (o.workers > 1 or o.engine == "ray") and (o.rank is not None or o.world_size is not None):
        raise CaptureError(
            "use either --workers N (writers started by actstore) or --rank/--world-size (one writer per launch), not both"
        )
    if o.rank is not None or o.world_size is not None:
        ranks.resolve(o.rank, o.world_size, {})
    if o.engine != "ray" and (o.gpus_per_worker or o.ray_address):
        raise CaptureError("--gpus-per-worker and --ray-address go with --engine ray")
    if o.cpus_per_worker <= 0 or o.gpus_per_worker < 0:
        raise CaptureError(
            f"--cpus-per-worker must be positive and --gpus-per-worker non-negative. Got {o.cpus_per_worker}, {o.gpus_per_worker}."
        )
    if o.pack and o.chunk:
        raise CaptureError(
            "give --pack (documents concatenated into windows) or --chunk (each document cut into windows), not both"
        )
    if (o.pack or o.chunk) != (o.context is not None):
        raise CaptureError(
            "--pack and --chunk need --context N (the window length in tokens), and --context needs one of them"
        )
    if o.context is not None and o.context < 1:
        raise CaptureError(f"--context must be a positive int. Got {o.context}.")
    if (o.pack or o.chunk) and (o.generate or o.chat_template or o.p_max or o.r_max or o.p_quantile or o.r_quantile):
        raise CaptureError(
            "--pack/--chunk store every token of the corpus in windows of --context tokens: "
            "--p-max, --r-max, quantiles, --generate and --chat-template do not apply"
        )
    unknown = [d for d in o.drop if d not in DROPPABLE]
    if unknown:
        raise CaptureError(f"--drop takes {list(DROPPABLE)}. Got {unknown}.")
    if o.special not in SPECIAL_MODES:
        raise CaptureError(f"--special must be one of {list(SPECIAL_MODES)}. Got {o.special!r}.")
    if o.p_max is not None and o.p_quantile is not None:
        raise CaptureError("give --p-max or --p-quantile, not both")
    if o.r_max is not None and o.r_quantile is not None:
        raise CaptureError("give --r-max or --r-quantile, not both")
    for name, q in (("--p-quantile", o.p_quantile), ("--r-quantile", o.r_quantile)):
        if q is not None and not 0 < q <= 1:
            raise CaptureError(f"{name} must be in (0, 1], e.g. 0.99. Got {q}.")
    for name, v in (("--p-max", o.p_max), ("--r-max", o.r_max)):
        if v is not None and v < 1:
            raise CaptureError(f"{name} must be a positive int. Got {v}.")
    if o.generate < 0:
        raise CaptureError(f"--generate must be a non-negative int. Got {o.generate}.")
    if o.generate and o.r_quantile is not None:
        raise CaptureError(
            "--r-quantile needs responses in the data; with --generate N the response budget is N (or --r-max)"
        )
    if o.commit_mb <= 0:
        raise CaptureError(f"--commit-mb must be positive. Got {o.commit_mb}.")
    if not 0 <= o.writer_nice <= 19:
        raise CaptureError(f"--writer-nice must be an int in 0..19. Got {o.writer_nice}.")
    if o.zarr_format not in spec.ZARR_FORMATS:
        raise CaptureError(f"--zarr-format must be one of {list(spec.ZARR_FORMATS)}. Got {o.zarr_format}.")
    if o.shard_examples != spec.SHARD_EXAMPLES_AUTO:
        if not isinstance(o.shard_examples, int) or o.shard_examples < 1:
            raise CaptureError(f"--shard-examples must be a positive int. Got {o.shard_examples}.")
        if o.zarr_format != 3:
            raise CaptureError("--shard-examples (Zarr sharding) needs --zarr-format 3")
