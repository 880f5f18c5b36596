"""The seams, as a matrix (issue 23): storage {local, s3:// on moto, gs:// on fake-gcs-server,
az:// on Azurite} x layout {chunk files, sharded} x data {ViT, packed LLM corpus,
prompt/response pairs}, pairwise (every pair of values in 12 of the 24 cells), through
capture, info, verify --deep, store[ex, layer] by number and by name, the loaders (0 and 2
workers), export-saev + verify-saev, export-saelens read by `datasets`, show and cp both
ways. Tiny models built from configs; each capture is made once per module and shared by the
cells. gs:// cells are seeded through the emulator's own upload API and test every read:
fake-gcs-server refuses obstore's uploads (tests/emulators.py)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import emulators
import forked
import numpy as np
import pytest
import s3server
import torch
from capture_support import PAIRS, SENTENCES, make_images, save_dinov2, save_llama, write_jsonl
from factory import cli
from watchdog import within

import actstore
from actstore.loaders.pairs import PairDataset
from actstore.loaders.tokens import TokenStream

STORAGES = ("local", "s3", "gs", "az")
LAYOUTS = {"chunks": ["--zarr-format", "2"], "sharded": ["--zarr-format", "3", "--shard-examples", "4"]}
DATA = ("vit", "packed", "pairs")
# Pairwise: every (storage, layout), (storage, data) and (layout, data) pair in 12 cells, the
# layout alternating over storage and data (the full product's 24 with ACTSTORE_FULL_MATRIX=1).
PAIRWISE = [(s, list(LAYOUTS)[(i + j) % 2], d) for i, s in enumerate(STORAGES) for j, d in enumerate(DATA)]
FULL = list(itertools.product(STORAGES, LAYOUTS, DATA))
CELLS = FULL if os.environ.get("ACTSTORE_FULL_MATRIX") == "1" else PAIRWISE
IDS = ["-".join(c) for c in CELLS]
GUARD_S = 120


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    make_images(root / "imgs", 5)
    docs = [" ".join(SENTENCES[(k + j) % len(SENTENCES)] for j in range(1 + k % 3)) for k in range(6)]
    return {
        "vit": ["--model", save_dinov2(root / "dino"), "--data", root / "imgs", "--layers", "0,2"],
        "packed": [
            "--model",
            save_llama(root / "llama", layers=3),
            "--data",
            write_jsonl(root / "c.jsonl", [{"text": d} for d in docs]),
            "--layers",
            "0,2",
            "--pack",
            "--context",
            "8",
        ],
        "pairs": ["--model", root / "llama", "--data", write_jsonl(root / "p.jsonl", PAIRS), "--layers", "0,2"],
    }


@pytest.fixture(scope="module")
def servers(s3_endpoint, az_endpoint, gs_endpoint):
    """moto, Azurite and fake-gcs-server: the session's (tests/conftest.py), their environment set."""
    return {"s3": s3_endpoint, "az": az_endpoint, "gs": gs_endpoint}


class Stores:
    """Captures made on first use and kept for the module: (storage, layout, data) -> location."""

    def __init__(self, root: Path, inputs, servers):
        self.root, self.inputs, self.servers, self.made = root, inputs, servers, {}

    def _bucket(self, storage: str, name: str) -> str:
        if storage == "s3":
            return f"s3://{s3server.create_bucket(self.servers['s3'], name)}"
        if storage == "az":
            return emulators.az_container(self.servers["az"], name)
        return emulators.gcs_bucket(self.servers["gs"], name)

    def __call__(self, storage: str, layout: str, data: str) -> str:
        key = (storage, layout, data)
        if key not in self.made:
            if storage == "local":
                url = str(self.root / f"{layout}-{data}")
                cli("write", url, *self.inputs[data], *LAYOUTS[layout], "--quiet")
            elif storage == "gs":  # seeded: the emulator takes no uploads from obstore
                local = self("local", layout, data)
                bucket = self._bucket("gs", f"m-{layout}-{data}")
                emulators.gcs_upload_tree(self.servers["gs"], bucket[5:], Path(local), "store")
                url = f"{bucket}/store"
            else:
                url = f"{self._bucket(storage, f'm-{layout}-{data}')}/store"
                cli("write", url, *self.inputs[data], *LAYOUTS[layout], "--quiet")
            self.made[key] = url
        return self.made[key]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, inputs, servers):
    return Stores(tmp_path_factory.mktemp("stores"), inputs, servers)


def _same_store(got: actstore.ActStore, want: actstore.ActStore) -> None:
    assert len(got) == len(want) and got.layers == want.layers and got.config.segments == want.config.segments
    for ex in range(len(want)):
        assert got.lengths(ex) == want.lengths(ex)
        for layer in want.layers:
            np.testing.assert_array_equal(got[ex, layer], want[ex, layer])


@pytest.mark.parametrize("storage,layout,data", CELLS, ids=IDS)
def test_capture_info_verify_and_reads(stores, storage, layout, data):
    url = stores(storage, layout, data)
    store, ref = actstore.ActStore(url), actstore.ActStore(stores("local", layout, data))
    _same_store(store, ref)  # a capture into this storage equals the local one
    np.testing.assert_array_equal(store[1, "blocks.2.hook_resid_post"], ref[1, 2])  # by name
    np.testing.assert_array_equal(store[1, -1], ref[1, 2])
    assert f"examples     {len(ref)}\n" in cli("info", url).output
    assert cli("verify", "--deep", url).output.startswith(f"verify (deep) {url}: {len(ref)} examples")


def _batches(loader):
    with within(GUARD_S, "a loader"):
        return [{k: v.clone() for k, v in b.items()} for b in loader]


def _equal(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("storage,layout,data", CELLS, ids=IDS)
def test_loaders_in_process(stores, storage, layout, data):
    store, ref = actstore.ActStore(stores(storage, layout, data)), actstore.ActStore(stores("local", layout, data))
    kw = dict(batch_size=8, seed=1, return_index=True, token_mask="content" if data != "vit" else None)
    assert _equal(_batches(TokenStream(store, **kw)), _batches(TokenStream(ref, **kw)))
    assert _equal(
        _batches(PairDataset(store).loader(batch_size=2, seed=3)),
        _batches(PairDataset(ref).loader(batch_size=2, seed=3)),
    )


# spawn on local files only: object storage under "fork" runs the loaders' forkserver, fresh
# interpreters as spawn's, so spawn there would test the same boundary again.
@pytest.mark.parametrize("storage,context", [("local", "spawn")] + [(s, "fork") for s in STORAGES])
def test_loaders_with_two_workers(stores, storage, context):
    url, ref = stores(storage, "sharded", "packed"), actstore.ActStore(stores("local", "sharded", "packed"))
    store = actstore.ActStore(url)
    kw = dict(batch_size=8, seed=1, return_index=True)
    want_t = _batches(TokenStream(ref, **kw))
    want_p = _batches(PairDataset(ref).loader(batch_size=2, seed=3))
    if storage != "local" and context == "fork":  # obstore does not survive fork: refused up front, with the fix
        with pytest.raises(ValueError, match=r"multiprocessing_context='fork' cannot read .*'spawn' or 'forkserver'"):
            TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context="fork")
        context = None  # the loaders' own default for object storage (forkserver)
    rows = lambda bs: sorted(
        map(tuple, torch.cat([torch.stack([b["example"], b["layer"], b["token"]], 1) for b in bs]).tolist())
    )  # noqa: E731
    got_t = _batches(TokenStream(store, **kw).loader(num_workers=2, multiprocessing_context=context, timeout=GUARD_S))
    assert rows(got_t) == rows(want_t)
    if context != "spawn":  # (spawn starts fresh interpreters: once per storage is enough, for the token stream)
        got_p = _batches(
            PairDataset(store).loader(
                batch_size=2, seed=3, num_workers=2, multiprocessing_context=context, timeout=GUARD_S
            )
        )
        assert _equal(got_p, want_p)


@pytest.mark.parametrize("storage,layout,data", CELLS, ids=IDS)
def test_exports(stores, storage, layout, data, tmp_path):
    import datasets

    url = stores(storage, layout, data)
    family = [] if data == "vit" else ["--family", "clip"]
    out = cli("export-saev", url, tmp_path / "saev" / "shards", *family, "--quiet").output.strip().splitlines()[-1]
    cli("verify-saev", out)
    if data != "vit":
        cli(
            "export-saelens",
            url,
            tmp_path / "lens",
            "--layer",
            "blocks.2.hook_resid_post",
            "--context-size",
            "4",
            "--quiet",
        )
        ds = datasets.load_from_disk(str(tmp_path / "lens"))
        ref = actstore.ActStore(stores("local", layout, data))
        assert len(ds) >= 1 and np.asarray(ds[0]["blocks.2.hook_resid_post"]).shape[1] == ref.d_model


@pytest.mark.parametrize("storage", STORAGES)
def test_show(stores, storage, tmp_path):
    cli("show", stores(storage, "chunks", "vit"), "--ex", "0", "--layer", "-1", "-o", tmp_path / "a.png")
    cli("show", stores("local", "chunks", "vit"), "--ex", "0", "--layer", "2", "-o", tmp_path / "b.png")
    from PIL import Image

    a, b = Image.open(tmp_path / "a.png"), Image.open(tmp_path / "b.png")
    assert a.size == b.size and a.tobytes() == b.tobytes()  # the same picture from every storage
    assert a.text["actstore:store"] == str(stores(storage, "chunks", "vit"))  # each names the store it drew
    assert len(a.text["actstore:manifest_sha256"]) == 64  # and the state of it (each storage holds its own write)


@pytest.mark.parametrize("storage,layout,data", CELLS, ids=IDS)
def test_cp_down(stores, storage, layout, data, tmp_path):
    cli("cp", stores(storage, layout, data), tmp_path / "down", "--quiet")
    _same_store(actstore.ActStore(tmp_path / "down"), actstore.ActStore(stores("local", layout, data)))


# gs: the emulator refuses obstore's uploads (tests/emulators.py). local: two capture workers
# writing a folder are test_capture_cli's (equal to one writer, both layouts) and cp into a
# folder test_copy's, so here only the object stores, where the writers race over the network.
# Slow: two writer processes (forked from the forkserver), each loading the model.
@pytest.mark.slow
@pytest.mark.parametrize("storage", ["s3", "az"])
def test_cp_up_and_two_writers(stores, storage, monkeypatch):
    # Spawned writers: test_capture_cli::test_workers_and_ranks_equal_a_single_writer.
    forked.writers_from_forkserver(monkeypatch)
    ref = actstore.ActStore(stores("local", "chunks", "packed"))
    dest = f"{stores._bucket(storage, f'up-{storage}')}/store"
    cli("cp", ref.path, dest, "--quiet")
    _same_store(actstore.ActStore(dest), ref)
    two = f"{stores._bucket(storage, f'two-{storage}')}/store"
    cli("write", two, *stores.inputs["packed"], *LAYOUTS["chunks"], "--workers", "2", "--quiet")
    got = actstore.ActStore(two)
    assert len(got.manifest.shards) == 2
    _same_store(got, ref)
