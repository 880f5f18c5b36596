"""A writer's options as values: `StoreConfig` (what the store is: actstore.layout.config)
and `WriterOptions` (how this writer writes it), each frozen and checked when made.

ShardWriter takes both whole (`ShardWriter(path, config=cfg, options=opts)`); its keyword
arguments (`WriterKeywords`, typed and partial: make_config's parameters and WriterOptions'
fields, as zarr-python's ArrayConfigParams beside its frozen value) are the convenience that
builds them, through one function: `from_keywords`.
`LayoutOptions` is what a capture asks of its store and writer (one part of
actstore.capture's CaptureOptions); its `writer_options()` is the WriterOptions it sets.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from actstore.layout import spec
from actstore.layout.config import StoreConfig, make_config
from actstore.layout.spool import BUDGET_HELP, parse_budget
from actstore.optionspec import check_positive, is_int, option

ON_NONFINITE = ("count", "raise")
ON_OVERFLOW = ("raise", "clip")
ENGINES = ("auto", "direct", "zarr")


MAX_THREADS = 256  # threads of one process (a writer's I/O threads, --threads): beyond this a value is a typo


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How one writer writes its shard (ShardWriter's Args describe each field)."""

    resume: bool = False
    overwrite: bool = False
    commit_bytes: int = spec.DEFAULT_COMMIT_BYTES
    on_nonfinite: str = "count"
    on_overflow: str = "raise"
    compressor: Any = None
    engine: str = "auto"
    stats: bool = False
    fsync: bool = False
    world_size: int | None = None
    io_threads: int | None = None
    io_bytes: int | None = None
    spool: int | str | None = None  # a spool's byte budget ("50GB", "512MiB", bytes); None: no spool

    def __post_init__(self) -> None:
        if self.spool is not None:  # held as bytes, whatever the spelling
            object.__setattr__(self, "spool", parse_budget(self.spool))
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {list(ON_NONFINITE)}. Got {self.on_nonfinite!r}.")
        if self.on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow must be one of {list(ON_OVERFLOW)}. Got {self.on_overflow!r}.")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}. Got {self.engine!r}.")
        if self.engine == "direct" and self.compressor is not None:
            raise ValueError("engine='direct' writes raw chunk files: it needs no compressor")
        for name in ("io_threads", "io_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None. Got {v!r}.")
        if self.io_threads is not None and self.io_threads > MAX_THREADS:
            raise ValueError(f"io_threads must be an int in 1..{MAX_THREADS} or None. Got {self.io_threads!r}.")

    def check_rank(self, shard: int) -> None:
        """world_size fits shard number `shard` (the shard number is the rank)."""
        w = self.world_size
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or not shard < w <= spec.MAX_WORLD_SIZE):
            raise ValueError(
                f"world_size must be an int in {shard + 1}..{spec.MAX_WORLD_SIZE} (the shard number is the rank). Got {w!r}."
            )


class WriterKeywords(TypedDict, total=False):
    """ShardWriter's keywords, each optional: the store's (make_config's parameters) and the
    writer's (WriterOptions' fields); ShardWriter's Args describe each one. A test checks
    that they are exactly those two lists."""

    layers: Sequence[int]
    d_model: int
    tokens: int | None
    segments: Mapping[str, int] | None
    dtype: Any
    t_chunk: int | Mapping[str, int] | None
    zarr_format: int
    shard_examples: int | str | None
    fields: Mapping[str, Any] | None
    texts: Sequence[str]
    token_labels: bool
    token_ids: bool
    token_label_names: Mapping[int, str] | None
    model_id: str | None
    attrs: Mapping[str, Any] | None
    resume: bool
    overwrite: bool
    commit_bytes: int
    on_nonfinite: str
    on_overflow: str
    compressor: Any
    engine: str
    stats: bool
    fsync: bool
    world_size: int | None
    io_threads: int | None
    io_bytes: int | None
    spool: int | str | None


CONFIG_KEYWORDS = tuple(p for p in inspect.signature(make_config).parameters if p != "segments_specs")
OPTION_KEYWORDS = tuple(f.name for f in fields(WriterOptions))


def store_config(config: StoreConfig | None, given: Mapping[str, Any]) -> StoreConfig:
    """`config`, or the StoreConfig that the keywords `given` (those not None) describe;
    never both. `shard_examples` is given unless it is "auto" (its default): None there
    asks for no Zarr sharding."""
    given = {
        k: v
        for k, v in given.items()
        if (v is not None or k == "shard_examples") and not (k == "shard_examples" and v == spec.SHARD_EXAMPLES_AUTO)
    }
    if config is not None:
        if given:
            raise TypeError(f"pass config= or the store's keywords, not both: got config= and {sorted(given)}")
        if not isinstance(config, StoreConfig):
            raise TypeError(
                f"config must be a StoreConfig (actstore.layout.config.make_config builds one). Got {type(config).__name__}."
            )
        return config
    missing = [k for k in ("layers", "d_model") if k not in given]
    if missing:
        raise TypeError(f"ShardWriter needs {' and '.join(f'{k}=' for k in missing)} (or config=, a StoreConfig)")
    return make_config(**given)


def writer_options(options: WriterOptions | None, given: Mapping[str, Any]) -> WriterOptions:
    """`options`, or the WriterOptions that the keywords `given` (those not None) set; never both."""
    given = {k: v for k, v in given.items() if v is not None}
    if options is not None:
        if given:
            raise TypeError(f"pass options= or the writer's keywords, not both: got options= and {sorted(given)}")
        if not isinstance(options, WriterOptions):
            raise TypeError(f"options must be a WriterOptions. Got {type(options).__name__}.")
        return options
    return WriterOptions(**given)


def from_keywords(
    config: StoreConfig | None, options: WriterOptions | None, keywords: Mapping[str, Any]
) -> tuple[StoreConfig, WriterOptions]:
    """The (StoreConfig, WriterOptions) of ShardWriter's arguments: `config` and `options`
    whole, or the keywords that build either (not both for one of them); an unknown keyword
    is refused, naming the known ones."""
    unknown = sorted(set(keywords) - set(CONFIG_KEYWORDS) - set(OPTION_KEYWORDS))
    if unknown:
        raise TypeError(
            f"ShardWriter got unknown keywords {unknown}; the store's are {list(CONFIG_KEYWORDS)}, "
            f"the writer's {list(OPTION_KEYWORDS)}"
        )
    opts = writer_options(options, {k: v for k, v in keywords.items() if k in OPTION_KEYWORDS})
    if (
        opts.spool is not None
        and config is None
        and keywords.get("shard_examples", spec.SHARD_EXAMPLES_AUTO) == (spec.SHARD_EXAMPLES_AUTO)
    ):
        keywords = {**keywords, "shard_examples": None}  # a spool removes files per example: no Zarr sharding
    cfg = store_config(config, {k: v for k, v in keywords.items() if k in CONFIG_KEYWORDS})
    return cfg, opts


# -- what a capture asks of its store and writer ---------------------------------------------

# The headings of `actstore write --help` (actstore.cli.sections) its options are listed under.
WHAT, LAYOUT, PIPE, WRITERS = (
    "What to record",
    "Store layout and commits",
    "The capture pipeline",
    "Writers and resuming",
)


def default_writer_threads() -> int:
    """Threads that write (or upload) shard files: half the cores, 2..8 (the other half
    converts, checksums and runs the model's host side)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


_ZARR_FORMAT_HELP = (
    "Zarr format of the store's arrays: 3, Zarr shard files of many examples (scales to billions of tokens and "
    "object storage); 2, the chunk-file layout (one file per example and layer)."
)
_SHARD_EXAMPLES_HELP = (
    "With --zarr-format 3: examples per Zarr shard file (one file holds every layer of N examples). Default: those "
    "that fill about 256 MiB."
)


@dataclass(frozen=True, kw_only=True)
class LayoutOptions:
    """What a capture asks of its store and its writer: the stored dtype, the layout, the
    commits (one frozen part of actstore.capture's CaptureOptions; `writer_options` is the
    WriterOptions it sets)."""

    dtype: str = option(
        spec.DEFAULT_DTYPE, "Stored dtype.", section=WHAT, choices=tuple(spec.ACT_DTYPES), show_default=True
    )
    stats: bool = option(True, "Do not keep running statistics.", section=WHAT)
    on_overflow: str = option(
        "raise",
        "Values beyond the stored dtype's range: stop with an error, or clip and count them.",
        section=WHAT,
        choices=ON_OVERFLOW,
        show_default=True,
    )
    zarr_format: int = option(
        spec.DEFAULT_ZARR_FORMAT, _ZARR_FORMAT_HELP, section=LAYOUT, choices=spec.ZARR_FORMATS, show_default=True
    )
    shard_examples: int | str | None = option(  # None (Python only): no Zarr sharding
        spec.SHARD_EXAMPLES_AUTO, _SHARD_EXAMPLES_HELP, section=LAYOUT, kind="int_or_auto"
    )
    commit_bytes: int = option(
        spec.DEFAULT_COMMIT_BYTES,
        "Commit (make durable) every this many MB of activations.",
        section=LAYOUT,
        flag="--commit-mb",
        scale=2**20,
        low=0.0,
        open_low=True,
        show_default=True,
    )
    fsync: bool = option(
        False, "Durable against power loss, not only crashes: every file synced before its commit.", section=LAYOUT
    )
    writer_threads: int | None = option(  # None: default_writer_threads()
        None,
        "Threads that write shard files and compute statistics on a CPU (default: half the cores, 2 to 8).",
        section=PIPE,
    )
    resume: bool = option(False, "Continue every writer after its last committed example.", section=WRITERS)
    spool: str | None = option(  # None: keep every token
        None,
        "Make the store a spool with this byte budget: blocks every registered consumer (TokenStream.follow(..., "
        f"consumer=NAME)) acknowledged are removed, and writers wait while the kept bytes would exceed it; {BUDGET_HELP}. "
        "Needs one activation file per example (--zarr-format 2, or 3 with no Zarr sharding: the default then).",
        section=WRITERS,
    )

    def writer_options(self, world_size: int | None) -> WriterOptions:
        """The options of the capture's ShardWriter (the shard's rank is checked against `world_size`)."""
        return WriterOptions(
            resume=self.resume,
            commit_bytes=self.commit_bytes,
            on_overflow=self.on_overflow,
            stats=self.stats,
            fsync=self.fsync,
            world_size=world_size,
            io_threads=self.writer_threads or default_writer_threads(),
            spool=self.spool,
        )

    def store_shard_examples(self) -> int | str | None:
        """Examples per Zarr shard file of the store: a spool's "auto" is no sharding (its
        files are removed per example)."""
        if self.spool is not None and self.shard_examples == spec.SHARD_EXAMPLES_AUTO:
            return None
        return self.shard_examples

    def check_layout(self, n: Any) -> None:
        """Reject contradictory layout and writer settings, named by `n` (field -> the caller's spelling)."""
        from actstore.errors import CaptureError

        check_positive(self, ("commit_bytes",), n, CaptureError)
        check_positive(self, ("writer_threads",), n, CaptureError, optional=True)
        if self.writer_threads is not None and self.writer_threads > MAX_THREADS:
            raise CaptureError(
                f"{n('writer_threads')} must be an int in 1..{MAX_THREADS} (threads beyond the cores only take "
                f"memory). Got {self.writer_threads!r}."
            )
        if self.on_overflow not in ON_OVERFLOW:
            raise CaptureError(f"{n('on_overflow')} must be one of {list(ON_OVERFLOW)}. Got {self.on_overflow!r}.")
        if self.dtype not in spec.ACT_DTYPES:
            raise CaptureError(f"{n('dtype')} must be one of {list(spec.ACT_DTYPES)}. Got {self.dtype!r}.")
        if self.zarr_format not in spec.ZARR_FORMATS:
            raise CaptureError(f"{n('zarr_format')} must be one of {list(spec.ZARR_FORMATS)}. Got {self.zarr_format}.")
        if self.shard_examples not in (spec.SHARD_EXAMPLES_AUTO, None):
            if not is_int(self.shard_examples) or self.shard_examples < 1:
                raise CaptureError(f"{n('shard_examples')} must be a positive int. Got {self.shard_examples}.")
            if self.zarr_format != 3:
                raise CaptureError(f"{n('shard_examples')} (Zarr sharding) needs {n('zarr_format')} 3")
        if self.spool is not None:
            from actstore.errors import SpoolError

            try:
                parse_budget(self.spool)
            except SpoolError as e:
                raise CaptureError(f"{n('spool')}: {e}") from None
            if self.shard_examples not in (spec.SHARD_EXAMPLES_AUTO, None):
                raise CaptureError(
                    f"{n('spool')} removes the activation files of consumed examples, one file per example: it cannot "
                    f"be used with {n('shard_examples')} (Zarr shard files of several examples); leave it out"
                )
