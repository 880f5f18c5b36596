"""Helpers of the integrity tests: deterministic stores, damage, and victim processes.

As a script it is the victim of the kill loop and the full-disk test:

    python tests/faultlib.py write STORE SHARD COUNT [--sleep S]
    python tests/faultlib.py finalize STORE
    python tests/faultlib.py export-saev STORE DUMP_TO
    python tests/faultlib.py write-fsize STORE SHARD COUNT AFTER LIMIT

tests run it with spawn() (forked with its imports done, tests/forked.py). Each prints
"ready" once imported and set up, then does its work and prints
"done <seconds>". Example k of shard s always holds `example_acts(s, k)`.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import forked
import numpy as np

LAYERS = [2, 7]
D = 16
SEGMENTS = {"prompt": 12, "response": 5}
T_CHUNK = {"prompt": 4, "response": 5}  # prompt: 3 token chunks per (example, layer)
BATCH = 4
COMMIT_BYTES = 3000  # a block every batch or two
HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def lengths(shard: int, k: int) -> dict[str, int]:
    return {"prompt": 1 + (7 * k + shard) % 12, "response": (3 * k + shard) % 6}


def example_acts(shard: int, k: int) -> dict[str, np.ndarray]:
    """(L, T_max, D) float16 per segment; zero past the example's length."""
    rng = np.random.default_rng(1000 * shard + k)
    out = {}
    for seg, t in SEGMENTS.items():
        x = rng.standard_normal((len(LAYERS), t, D)).astype(np.float16)
        x[:, lengths(shard, k)[seg] :] = 0
        out[seg] = x
    return out


def expected(shard: int, k: int, layer: int) -> np.ndarray:
    """What ActStore returns for (example k of shard, layer): prompt[:p] then response[:r]."""
    acts, n = example_acts(shard, k), lengths(shard, k)
    lp = LAYERS.index(layer)
    return np.concatenate([acts["prompt"][lp, : n["prompt"]], acts["response"][lp, : n["response"]]])


def writer(path, shard: int, **kw):
    from actstore import ShardWriter

    kw = {"zarr_format": 2, **kw}  # the chunk-file layout: the fault tests name its files
    return ShardWriter(
        path,
        shard=shard,
        layers=LAYERS,
        d_model=D,
        segments=SEGMENTS,
        t_chunk=T_CHUNK,
        texts=["prompt"],
        fields={"label": "int64"},
        stats=True,
        commit_bytes=COMMIT_BYTES,
        **kw,
    )


def append_range(w, shard: int, first: int, stop: int, sleep: float = 0.0) -> None:
    """Append examples first..stop-1 of `shard` in batches of BATCH."""
    k = first
    while k < stop:
        ks = list(range(k, min(k + BATCH, stop)))
        acts = [example_acts(shard, i) for i in ks]
        w.append(
            prompt=np.stack([a["prompt"] for a in acts]),
            response=np.stack([a["response"] for a in acts]),
            lengths={s: np.array([lengths(shard, i)[s] for i in ks]) for s in SEGMENTS},
            sample_keys=[f"{shard}-{i}" for i in ks],
            fields={"label": np.array(ks)},
            texts={"prompt": [f"text {shard}-{i}" for i in ks]},
        )
        k = ks[-1] + 1
        if sleep:
            time.sleep(sleep)


def write_shard(path, shard: int, count: int, sleep: float = 0.0) -> int:
    """Write (or resume and finish) `count` examples of `shard`; returns where it started."""
    from actstore.errors import ShardCompleteError

    resume = (Path(path) / "shards" / f"shard-{shard:05d}.zarr").exists()
    try:
        w = writer(path, shard, resume=resume)
    except ShardCompleteError:
        return count
    with w:
        start = w.n_committed
        append_range(w, shard, start, count, sleep)
    return start


def check_store_values(path, counts: dict[int, int]) -> int:
    """Every example of a finalized store (shards in `counts`, in order) holds its data."""
    from actstore import ActStore

    st = ActStore(path)
    assert len(st) == sum(counts.values())
    g = 0
    for shard, n in sorted(counts.items()):
        for k in range(n):
            for layer in LAYERS:
                np.testing.assert_array_equal(st[g, layer], expected(shard, k, layer))
            g += 1
    assert list(st.field("sample_key")) == [f"{s}-{k}" for s, n in sorted(counts.items()) for k in range(n)]
    assert list(st.field("label")) == [k for s, n in sorted(counts.items()) for k in range(n)]
    assert list(st.texts("prompt")) == [f"text {s}-{k}" for s, n in sorted(counts.items()) for k in range(n)]
    return g


def saev_kwargs() -> dict:
    return dict(
        cls="none", family="clip", ckpt="test/vit", dataset="/tmp", patches_per_shard=17 * 2 * 8, progress=False
    )


# ---- damage -----------------------------------------------------------------------------
def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def flip_bit(path: Path, byte: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 1 << bit
    path.write_bytes(bytes(data))


# ---- victim processes ------------------------------------------------------------------
def spawn(*args: str) -> forked.Child:
    """This script's stage `args` in a process of its own, forked with its imports done (tests/forked.py)."""
    return forked.start(HERE / "faultlib.py", *args)


def wait_ready(proc: forked.Child) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"victim did not start: {line!r} {proc.stderr.read()}")


def run_to_end(*args: str) -> float:
    """Run a victim to completion; returns the seconds its work took."""
    proc = spawn(*args)
    wait_ready(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return float(out.split()[-1])


def kill_after(proc: forked.Child, delay: float) -> bool:
    """SIGKILL `proc` after `delay` seconds of work; True if it was still working then."""
    wait_ready(proc)
    time.sleep(delay)
    alive = proc.poll() is None
    proc.kill()
    proc.communicate(timeout=60)
    return alive


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _main(argv: list[str]) -> None:
    stage = argv[0]
    if stage == "write":
        import actstore  # noqa: F401  (imports before "ready")

        path, shard, count = argv[1], int(argv[2]), int(argv[3])
        sleep = float(argv[5]) if len(argv) > 5 and argv[4] == "--sleep" else 0.0
        print("ready", flush=True)
        t = time.perf_counter()
        write_shard(path, shard, count, sleep)
    elif stage == "finalize":
        import actstore

        print("ready", flush=True)
        t = time.perf_counter()
        actstore.finalize(argv[1])
    elif stage == "export-saev":
        from actstore import ActStore, export_saev

        st = ActStore(argv[1])
        print("ready", flush=True)
        t = time.perf_counter()
        export_saev(st, argv[2], **saev_kwargs())
    elif stage == "write-fsize":
        import resource

        from actstore.errors import DiskFullError

        path, shard, count, after, limit = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
        print("ready", flush=True)
        t = time.perf_counter()
        w = writer(path, shard)
        try:
            append_range(w, shard, 0, after)
            w.commit()
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            append_range(w, shard, after, count)
            w.close()
        except DiskFullError as e:
            print(f"DiskFullError {e.errno} {e}", flush=True)
            sys.exit(3)
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    print(f"done {time.perf_counter() - t:.4f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _main(sys.argv[1:])
