"""The data files of a site (`actstore view`): what the shipped pages read, as scripts that
hand a JSON value to `ACTSTORE.load(kind, value)` (scripts, not fetches: pages opened from
file:// may not fetch).

- `data/meta.js`: the pass (store, layer, encoder, counts, histogram edges, window, notes);
- `data/index.js`: one column per field over every feature (feature, max, min, density,
  density_negative, mean, n_active, and the top example's text around its token);
- `data/vocab.js`: every token id the site shows (`ids`), its text alone (`text`; `raw`: the
  positions whose text is a split character's bytes) and, where different, its text inside
  a text (`ctx`: {position: text}), the default of a window's token;
- `data/f/<feature // 1000>/<feature>.js`: a feature's statistics, histograms, rows (top and
  bottom activations, interval samples) with their windows as vocab positions and
  activations (integers of `scale`), the window tokens whose text is not their vocabulary
  default (`px`: [flat index, text]; a window's text is cut from one decode of it) and the
  partial ones (`part`: flat indices), document keys, the tokens most often active, decoder
  neighbours, co-occurring features and logit tables; of a ViT store, its images and their
  per-patch values instead of windows (actstore.features.views.sitevision), the images in `img/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.features.topk.passdata import PassData
from actstore.inputs.tokentext import REPLACEMENT, Pieces, TokenText

BUCKET = 1000  # features per data/f/ folder
ACT_LEVELS = 1000  # window activations are written as integers of max|act| / ACT_LEVELS
SNIPPET = (40, 24, 40)  # characters of the index's text: before, after, and of the token itself
KIND_TOP, KIND_BOTTOM, KIND_INTERVAL = 0, 1, 2


def script(kind: str, value: Any) -> str:
    """The text of a data script: `ACTSTORE.load("kind", <JSON>);` (`</` escaped so that no
    string ends the script early)."""
    return f'ACTSTORE.load("{kind}",' + json.dumps(value, separators=(",", ":")).replace("</", "<\\/") + ");\n"


def position_bytes(n_vocab: int) -> int:
    """Bytes of a vocabulary position in the window arrays: 2 while they fit an int16."""
    return 2 if n_vocab < 1 << 15 else 4


PACKED_TYPES = ("<i2", "<i4", "<f2", "<f4", "<f8")  # what ACTSTORE.unpack decodes (<f2: float16, to numbers)


def pack(values: np.ndarray, dtype: str | None = None) -> list[str]:
    """An array as [dtype, base64 of its little-endian bytes] (encoded in C; a page decodes it
    into a typed array). Integers take the narrowest of <i2, <i4 that holds them (<f8 beyond:
    exact to 2**53)."""
    import base64

    values = np.asarray(values)
    if dtype is None:
        lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
        dtype = "<i2" if -(1 << 15) <= lo and hi < 1 << 15 else "<i4" if -(1 << 31) <= lo and hi < 1 << 31 else "<f8"
    if dtype not in PACKED_TYPES:
        raise ValueError(f"dtype must be one of {list(PACKED_TYPES)}. Got {dtype!r}.")
    return [dtype, base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")]


def unpack(rec: dict[str, Any]) -> dict[str, Any]:
    """A feature record with its packed columns decoded: `rows` (g, rank, ex, tok, act, and doc,
    dt, im where kept) as lists, `v`, `a`, `pi`, `pv` as arrays (what feature.html decodes; for
    readers)."""
    import base64

    cols = {k: np.frombuffer(base64.b64decode(b), dtype=t) for k, (t, b) in rec.get("cols", {}).items()}
    out = {k: v for k, v in rec.items() if k != "cols"}
    out["rows"] = {k: cols[k].tolist() for k in ("g", "rank", "ex", "tok", "act", "doc", "dt", "im") if k in cols}
    for k in ("v", "a", "pi", "pv"):
        if k in cols:
            out[k] = cols[k]
    return out


def feature_path(f: int) -> str:
    return f"data/f/{f // BUCKET}/{f}.js"


def short_float(x: float) -> float:
    """x to 4 significant digits (what a page shows), as a short JSON number."""
    return float(f"{float(x):.4g}")


@dataclass(frozen=True)
class Rows:
    """Every row a site shows, sorted by (feature, kind, interval, rank): kind KIND_TOP
    (positive tail), KIND_BOTTOM (negative tail) or KIND_INTERVAL, with the interval's bounds."""

    feature: np.ndarray
    kind: np.ndarray
    interval: np.ndarray
    rank: np.ndarray
    sign: np.ndarray
    example: np.ndarray
    token: np.ndarray
    activation: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    exact: np.ndarray

    def __len__(self) -> int:
        return len(self.feature)

    def bounds(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each feature's row range [start, end)."""
        return np.searchsorted(self.feature, features), np.searchsorted(self.feature, features, side="right")


def gather_rows(p: PassData) -> Rows:
    """The top, bottom and interval rows of a pass, in page order."""
    t, iv = p.top, p.intervals
    n_t, n_i = len(t["feature"]), len(iv["feature"])
    sign = np.concatenate([t["sign"], iv["sign"]]).astype(np.int8)
    kind = np.concatenate([np.where(t["sign"] > 0, KIND_TOP, KIND_BOTTOM), np.full(n_i, KIND_INTERVAL)]).astype(np.int8)
    # one group per (sign, interval): the negative tail's intervals after the positive one's
    interval = np.concatenate([np.full(n_t, -1), np.where(iv["sign"] > 0, 0, 1 << 20) + iv["interval"]])
    cols = dict(
        feature=np.concatenate([t["feature"], iv["feature"]]).astype(np.int64),
        kind=kind,
        interval=interval.astype(np.int64),
        rank=np.concatenate([t["rank"], iv["sample"]]).astype(np.int64),
        sign=sign,
        example=np.concatenate([t["example"], iv["example"]]).astype(np.int64),
        token=np.concatenate([t["token"], iv["token"]]).astype(np.int64),
        activation=np.concatenate([t["activation"], iv["activation"]]).astype(np.float32),
        lo=np.concatenate([np.zeros(n_t), iv["lo"]]).astype(np.float64),
        hi=np.concatenate([np.zeros(n_t), iv["hi"]]).astype(np.float64),
        exact=np.concatenate([np.ones(n_t, bool), iv["exact"]]).astype(bool),
    )
    order = np.lexsort((cols["rank"], cols["interval"], cols["kind"], cols["feature"]))
    return Rows(**{k: v[order] for k, v in cols.items()})


def histogram(counts: np.ndarray) -> list[Any] | None:
    """[first bin, counts of the bins from the first to the last non-empty one], or None."""
    nz = np.flatnonzero(counts)
    if not len(nz):
        return None
    return [int(nz[0]), counts[nz[0] : nz[-1] + 1].tolist()]


def stats(p: PassData, j: int) -> dict[str, Any]:
    """Feature j's statistics (densities as fractions; the page shows percents)."""
    c = p.features
    out = {
        "max": short_float(c["max"][j]),
        "density": float(c["density"][j]),
        "mean_active": short_float(c["mean_active"][j]),
        "n_active": int(c["n_active"][j]),
        "n_tokens": int(c["n_tokens"][j]),
    }
    if p.has_negative:
        out |= {
            "min": short_float(c["min"][j]),
            "density_negative": float(c["density_negative"][j]),
            "mean_negative": short_float(c["mean_negative"][j]),
            "n_negative": int(c["n_negative"][j]),
        }
    return out


class Vocab:
    """The token ids a site shows, as positions into data/vocab.js: each id's text alone
    (`text`, for token lists; a token holding part of a character as its bytes, `raw`),
    and its text inside a text where that differs (`ctx`, the default of a window's token;
    actstore.inputs.tokentext). Without a tokenizer each id is written as its number."""

    def __init__(self, ids: np.ndarray, tt: TokenText) -> None:
        self.ids = np.unique(ids[ids >= 0])
        self.text, raw = tt.labels(self.ids)
        self.raw = np.flatnonzero(raw).tolist()
        self.ctx = tt.context_text(self.ids)
        self._clean = [REPLACEMENT not in c for c in self.ctx]

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Positions of `ids` in the vocab (-1 stays -1)."""
        pos = np.searchsorted(self.ids, ids)
        return np.where(ids >= 0, pos, -1)

    def value(self) -> dict[str, Any]:
        ctx = {str(p): c for p, (c, t, ok) in enumerate(zip(self.ctx, self.text, self._clean)) if ok and c != t}
        return {"ids": self.ids.tolist(), "text": self.text, "ctx": ctx, "raw": self.raw}

    def window(self, positions: np.ndarray, pieces: Pieces) -> tuple[list[list[Any]], list[int]]:
        """A window's tokens as a page draws them: ([column, text] of each token whose piece
        is not its vocabulary default, the columns of partial tokens). Columns count from the
        window's first column; `positions` are its vocabulary positions (-1 outside)."""
        cols = np.flatnonzero(positions >= 0)
        out = []
        for c, p, t in zip(cols.tolist(), positions[cols].tolist(), pieces.text):
            if not self._clean[p] or t != self.ctx[p]:
                out.append([c, t])
        return out, cols[pieces.partial].tolist()


def snippet(pieces: Pieces, positions: np.ndarray, before: int) -> list[str]:
    """[text before, the token, text after] of one window (for the index); when the row's
    token holds part of a character, the token runs on to the token that completes it."""
    k = before - int(np.argmax(positions >= 0))  # the row's token among the window's pieces
    end = k + 1
    while end < len(pieces) and pieces.partial[end - 1]:
        end += 1
    b, a, t = SNIPPET
    left, tok, right = "".join(pieces.text[:k]), "".join(pieces.text[k:end]), "".join(pieces.text[end:])
    return [left[-b:], tok if len(tok) <= t else tok[:t] + "\u2026", right[:a]]
