"""The attention-sink check: a kept token position whose activations dwarf the others'.

A language model parks attention on its first position, whose residual stream then grows
to tens or hundreds of times the norm of the other tokens' (an attention sink). Counted as
content it dominates the statistics, the loaders' normalisation and the top activations of
most features. The capture keeps it out of the default mask by labelling it (a BOS, or the
kind `first`: `actstore write --bos auto`); a store written with `--bos never` (or before
the option existed), or a read that keeps every token (`--special keep`), counts it.

`find_sinks` reads a sample of examples (spread evenly over the store; as many as
SAMPLE_BYTES of activations hold, MIN_EXAMPLES..MAX_EXAMPLES) and, per layer and segment,
compares the mean L2 norm of the kept tokens at each of the first POSITIONS stored
positions with the median of the other positions' means: one more than SINK_RATIO times
that median is a sink. It needs nothing recorded at capture, so old stores are checked too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.layout.spec import TOKEN_LABELS_SUFFIX
from actstore.read.interface import Reader
from actstore.read.masks import leaves_out_special

SINK_RATIO = 10.0  # a position's mean norm over the median of the others' that makes it a sink
POSITIONS = 16  # the first stored positions compared
SAMPLE_BYTES = 64 * 2**20  # activations read for the check (at least MIN_EXAMPLES examples)
MIN_EXAMPLES, MAX_EXAMPLES = 8, 256


@dataclass(frozen=True)
class Sink:
    """A stored position whose kept tokens' mean L2 norm is over SINK_RATIO x the median
    of the other positions' means.

    Attributes:
        layer, segment, position: where (position: the stored token index in the segment).
        mean_norm: the position's mean L2 norm over the sampled examples.
        others_median: the median of the other positions' mean norms.
        labelled: the default mask leaves the position out (its tokens are labelled as a
            kind other than content): only a read that keeps every token counts it.
    """

    layer: int
    segment: str
    position: int
    mean_norm: float
    others_median: float
    labelled: bool

    @property
    def ratio(self) -> float:
        return self.mean_norm / self.others_median

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "segment": self.segment,
            "position": self.position,
            "mean_norm": self.mean_norm,
            "others_median": self.others_median,
            "ratio": self.ratio,
            "labelled": self.labelled,
        }


def sample_examples(store: Reader, layers: int) -> np.ndarray:
    """The examples the check reads: evenly spread, as many as SAMPLE_BYTES hold."""
    n = len(store)
    cfg = store.config
    per_example = max(1, sum(s.t_max for s in cfg.segments) * cfg.d_model * cfg.itemsize * layers)
    k = min(n, max(MIN_EXAMPLES, min(MAX_EXAMPLES, SAMPLE_BYTES // per_example)))
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64)) if k else np.zeros(0, np.int64)


def find_sinks(
    store: Reader,
    *,
    keep_all: bool = False,
    layers: Sequence[int] | None = None,
    segments: Sequence[str] | None = None,
) -> list[Sink]:
    """The sinks among the tokens a read keeps, per layer and segment.

    Args:
        store: any Reader.
        keep_all: the read keeps every token (`--special keep`, token_mask "all");
            otherwise the store's default mask applies.
        layers, segments: the stored layer numbers and segments checked (default: all).
    """
    layers = list(store.layers if layers is None else layers)
    segments = list(store.segments if segments is None else segments)
    examples = sample_examples(store, len(layers))
    if getattr(store, "removed", None) is not None:  # a spool: only examples whose activations are kept
        examples = store.removed.kept(store.index, store.manifest, examples)
    if not len(examples) or not layers:
        return []
    keeps = store.config.default_keeps if leaves_out_special(store) else None
    out = []
    for seg in segments:
        labels = np.asarray(store.field(seg + TOKEN_LABELS_SUFFIX))[examples] if keeps is not None else None
        lengths = np.asarray(store.segment(seg).lengths())[examples]
        t = min(POSITIONS, int(lengths.max()) if len(lengths) else 0)
        real = np.arange(t)[None, :] < lengths[:, None]  # (examples, t)
        off = labels[:, :t] != keeps if labels is not None else np.zeros_like(real)
        kept = real if keep_all else real & ~off
        for layer in layers:
            sums = np.zeros(t)
            for j, ex in enumerate(examples):
                x = np.asarray(store.segment(seg)[int(ex), layer][:t], np.float32)
                sums[: len(x)] += np.where(kept[j, : len(x)], np.linalg.norm(x, axis=1), 0.0)
            out += _sinks_of(layer, seg, sums, kept.sum(0), (off & real).sum(0) * 2 > real.sum(0))
    return out


def _sinks_of(layer: int, seg: str, sums: np.ndarray, counts: np.ndarray, labelled: np.ndarray) -> list[Sink]:
    """The positions whose mean is over SINK_RATIO x the median of the others' (two or more)."""
    have = np.flatnonzero(counts)
    if len(have) < 3:
        return []
    means = sums[have] / counts[have]
    found = []
    for i, p in enumerate(have):
        median = float(np.median(np.delete(means, i)))
        if median > 0 and means[i] > SINK_RATIO * median:
            found.append(Sink(layer, seg, int(p), float(means[i]), median, bool(labelled[p])))
    return found


def sink_warning(sinks: Sequence[Sink], store: Reader) -> str | None:
    """One line naming the sinks and the fix (None: no sink)."""
    if not sinks:
        return None
    where = "; ".join(
        f"layer {s.layer}{'' if len(store.segments) == 1 else ' ' + s.segment} token {s.position}: "
        f"{s.ratio:,.0f}x ({s.mean_norm:,.4g} vs {s.others_median:,.4g})"
        for s in sinks[:6]
    ) + (f"; and {len(sinks) - 6} more" if len(sinks) > 6 else "")
    if all(s.labelled for s in sinks):
        fix = "drop --special keep (the default mask leaves these labelled tokens out)"
    elif store.config.token_ids and all(s.position == 0 for s in sinks):
        fix = "rerun the capture with --bos auto (token 0 becomes a labelled BOS the default mask leaves out)"
    else:
        fix = "rerun the capture with --bos auto (texts) or --special drop (a ViT's CLS), or leave these tokens out of what you read"
    return (
        f"attention sink counted as content: the mean L2 norm of a kept position is over {SINK_RATIO:g}x the "
        f"median of the others ({where}); it skews statistics, normalisation and top activations. Fix: {fix}"
    )
