"""A writer's options as values: `StoreConfig` (what the store is: actstore.layout.config)
and `WriterOptions` (how this writer writes it), each frozen and checked when made.

ShardWriter takes both whole (`ShardWriter(path, config=cfg, options=opts)`); its keyword
arguments (`WriterKeywords`, typed and partial: make_config's parameters and WriterOptions'
fields, as zarr-python's ArrayConfigParams beside its frozen value) are the convenience that
builds them, through one function: `from_keywords`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from actstore.layout import spec
from actstore.layout.config import StoreConfig, make_config

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

    def __post_init__(self) -> None:
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
    cfg = store_config(config, {k: v for k, v in keywords.items() if k in CONFIG_KEYWORDS})
    return cfg, opts
