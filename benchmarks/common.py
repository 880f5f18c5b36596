"""Shared benchmark helpers: timing, page-cache control, result files."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def drop_cache(path: str | os.PathLike) -> None:
    """Evict a file or every file under a folder from the page cache (posix_fadvise DONTNEED)."""
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def add_store_shape_args(ap, examples: int = 2000) -> None:
    """The synthetic ViT-like store's shape (shared by the store and loader benchmarks)."""
    ap.add_argument("--examples", type=int, default=examples)
    ap.add_argument("--tokens", type=int, default=257)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def save(name: str, result: dict, out_dir: str | os.PathLike = "bench-results") -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **result}, indent=1))
    return path


def percentile_us(samples_s: list[float], q: float) -> float:
    s = sorted(samples_s)
    return 1e6 * s[min(len(s) - 1, int(q / 100 * len(s)))]
