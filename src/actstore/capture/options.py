"""CaptureOptions: every setting of a capture, one frozen value from the CLI to the writer.

It is composed of the parts each layer owns, each field's default and help spelled once
beside it (actstore.optionspec): InputOptions (the model, the data, texts and windows:
actstore.inputs.options), PipelineOptions (what is recorded and who writes it: here) and
LayoutOptions (the stored dtype, the layout, the commits: actstore.write.options).
`actstore write` offers every field with an OptionSpec as an option (field = option:
`batch_size` is `--batch-size`; actstore.cli.fields builds them), `actstore.record` takes
them as keywords (RecordSettings); `check` rejects contradictory settings before anything
is loaded or written, naming them as the caller spelled them (`--writer-nice` on the
command line, `writer_nice` in Python). The writer's own part travels on as
`writer_options()` (a WriterOptions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from actstore.devices import parse_device
from actstore.errors import CaptureError
from actstore.inputs.options import InputOptions
from actstore.optionspec import check_positive, is_int, option
from actstore.write.options import PIPE, WHAT, WRITERS, LayoutOptions, default_writer_threads

__all__ = [
    "CaptureOptions",
    "InputOptions",
    "LayoutOptions",
    "PipelineOptions",
    "RecordSettings",
    "check_job",
    "default_writer_threads",
    "make_options",
]

RUNNERS = ("local", "ray")
SPECIAL = ("keep", "mask", "drop")  # special and template tokens: stored as content, labelled, left out
DROPPABLE = ("bos", "cls")  # --drop (deprecated): tokens the model sees but the store leaves out
DEFAULT_QUEUE = 4
DEFAULT_WRITER_NICE = 10  # the writer threads' priority drop (Linux nice, per thread)

_LAYERS_HELP = (
    "Blocks to record, e.g. 6,11, 0-11 or -1 (layer N = output of block N = hidden_states[N+1]; -1 the last block), "
    "TransformerLens site names (blocks.8.hook_resid_post, hook_resid_pre, hook_resid_mid, hook_attn_out, "
    "hook_mlp_in, hook_mlp_out, attn.hook_z, mlp.hook_post; docs/capture.md, 'Sites'), or module paths such as "
    "model.layers.6.mlp."
)
_SPECIAL_HELP = (
    "Special tokens (BOS, EOS, chat-template text; a ViT's CLS): store them labelled, left out by the loaders' "
    "default mask and the statistics (mask), store them as content, unlabelled (keep), or do not store them "
    "(drop; the model still sees them)."
)
_RUNNER_HELP = (
    "Where --workers run: local processes (default), or actors on a Ray cluster (RAY_ADDRESS / --ray-address, "
    "else a local one; pip install 'actstore[ray]')."
)


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """What is recorded, the capture pipeline, and who writes: ranks and runners."""

    # -- what is recorded --
    layers: tuple[int | str, ...] = option((), _LAYERS_HELP, section=WHAT, kind="layers", required=True)
    special: str = option("mask", _SPECIAL_HELP, section=WHAT, choices=SPECIAL, show_default=True)
    drop: tuple[str, ...] = option(  # deprecated spelling (--drop bos|cls), kept one release
        (), "Deprecated: --special drop.", section=WHAT, choices=DROPPABLE, multiple=True, hidden=True
    )
    token_ids: bool | None = None  # None: when the batches carry input_ids
    # -- the pipeline --
    queue_size: int = option(
        DEFAULT_QUEUE,
        "Batches the writer may lag behind the model (host memory: queue size + 2 batches).",
        section=PIPE,
        show_default=True,
    )
    writer_nice: int = option(
        DEFAULT_WRITER_NICE,
        "Lower the writer threads' priority by N (Linux nice, per thread) so that they run in the model's gaps; "
        "0: normal priority.",
        section=PIPE,
        low=0,
        high=19,
        show_default=True,
    )
    stop_early: bool = True
    # -- who writes: ranks and runners --
    workers: int = option(
        1,
        "Writers actstore starts (one shard each): processes on this machine, or actors with --runner ray.",
        section=WRITERS,
        show_default=True,
    )
    runner: str = option("local", _RUNNER_HELP, section=WRITERS, choices=RUNNERS)  # local: processes here
    cpus_per_worker: float = option(
        1.0, "With --runner ray: CPUs each writer actor reserves.", section=WRITERS, show_default=True
    )
    gpus_per_worker: float = option(
        0.0,
        "With --runner ray: GPUs each writer actor reserves (use --device cuda).",
        section=WRITERS,
        show_default=True,
    )
    ray_address: str | None = option(
        None, "With --runner ray: the cluster to join (default RAY_ADDRESS, else a local cluster).", section=WRITERS
    )
    rank: int | None = option(  # None (with world_size None): from Slurm/torchrun variables, else 0 of 1
        None,
        "This writer's rank; writes shard RANK. Default: from SLURM_ARRAY_TASK_ID, SLURM_PROCID or RANK (torchrun), "
        "else 0.",
        section=WRITERS,
    )
    world_size: int | None = option(
        None,
        "Number of ranks (default: from Slurm or torchrun, else 1); run `actstore finalize STORE` once all are done.",
        section=WRITERS,
    )
    # -- actstore write's job --
    store: str | None = None  # the command's STORE argument
    finalize: bool = option(True, "Leave the store unfinalized (run `actstore finalize` later).", section=WRITERS)
    progress: bool = True  # the command's --quiet turns it off

    @property
    def drop_cls(self) -> bool:
        """Image stores leave out token 0 (a ViT's CLS): --special drop (or --drop cls)."""
        return "cls" in self.drop

    @property
    def drop_bos(self) -> bool:
        return "bos" in self.drop

    def check_pipeline(self, n: Any) -> None:
        """Reject contradictory pipeline settings, named by `n` (field -> the caller's spelling)."""
        if not is_int(self.writer_nice) or not 0 <= self.writer_nice <= 19:
            raise ValueError(f"{n('writer_nice')} must be an int in 0..19. Got {self.writer_nice!r}.")
        check_positive(self, ("workers", "queue_size"), n, CaptureError)
        if self.runner not in RUNNERS:
            raise CaptureError(f"{n('runner')} must be one of {list(RUNNERS)}. Got {self.runner!r}.")
        if self.special not in SPECIAL:
            raise CaptureError(f"{n('special')} must be one of {list(SPECIAL)}. Got {self.special!r}.")
        unknown = [d for d in self.drop if d not in DROPPABLE]
        if unknown:
            raise CaptureError(f"--drop takes {list(DROPPABLE)}. Got {unknown}.")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0:
            raise CaptureError(
                f"{n('cpus_per_worker')} must be positive and {n('gpus_per_worker')} non-negative. "
                f"Got {self.cpus_per_worker}, {self.gpus_per_worker}."
            )


@dataclass(frozen=True, kw_only=True)
class CaptureOptions(InputOptions, PipelineOptions, LayoutOptions):
    """Every setting of a capture (`actstore write --help` describes each option): the
    fields of InputOptions, PipelineOptions and LayoutOptions, each part also a value of
    its own (`inputs`, `pipeline`, `layout`).

    record() reads the fields of PipelineOptions and LayoutOptions; `actstore write` (the
    job from a model name and a data path) reads them all.
    """

    @property
    def inputs(self) -> InputOptions:
        """The model, the data, texts and windows."""
        return _part(self, InputOptions)

    @property
    def pipeline(self) -> PipelineOptions:
        """What is recorded, the pipeline, the writers."""
        return _part(self, PipelineOptions)

    @property
    def layout(self) -> LayoutOptions:
        """The stored dtype, the layout and the commits."""
        return _part(self, LayoutOptions)

    def check(self, names: str = "python") -> None:
        """Reject contradictory settings; `names` "cli" spells them as options (--batch-size)."""
        n = (lambda f: "--" + f.replace("_", "-")) if names == "cli" else (lambda f: f)
        self.check_pipeline(n)
        self.check_layout(n)
        self.check_inputs(n)


def _part(o: CaptureOptions, cls: type) -> Any:
    return cls(**{f.name: getattr(o, f.name) for f in fields(cls)})


FIELDS = tuple(f.name for f in fields(CaptureOptions))


class RecordSettings(TypedDict, total=False):
    """CaptureOptions' fields as keywords of record(), each optional (zarr's partial-options
    pattern: the frozen value beside a TypedDict of its fields; tests/test_cli_options.py
    holds the two to one list of names and types)."""

    model: str | None
    data: str | None
    device: str
    model_dtype: str
    batch_size: int
    threads: int | None
    max_examples: int | None
    text_field: str | None
    encoding: str
    errors: str
    p_max: int | None
    r_max: int | None
    p_quantile: float | None
    r_quantile: float | None
    separator: str
    bos: str
    chat_template: bool
    system: str | None
    generate: int
    temperature: float
    top_p: float
    seed: int
    pack: bool
    chunk: bool
    context: int | None
    window_bos: bool
    layers: Sequence[int | str]  # (the field: a tuple; record() takes any sequence)
    special: str
    drop: tuple[str, ...]
    token_ids: bool | None
    queue_size: int
    writer_nice: int
    stop_early: bool
    workers: int
    runner: str
    cpus_per_worker: float
    gpus_per_worker: float
    ray_address: str | None
    rank: int | None
    world_size: int | None
    store: str | None
    finalize: bool
    progress: bool
    dtype: str
    stats: bool
    on_overflow: str
    zarr_format: int
    shard_examples: int | str | None
    commit_bytes: int
    fsync: bool
    writer_threads: int | None
    resume: bool
    spool: str | None


class OldRecordSettings(RecordSettings, total=False):
    """RecordSettings with the spellings kept one release (a DeprecationWarning each)."""

    engine: str  # runner=
    drop_cls: bool  # drop=("cls",)


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
