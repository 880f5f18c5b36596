"""Corpus capture (docs/capture.md, "Corpora"): --pack and --chunk windows, token ids, runs that
map every stored token back to its document, and the document formats (.txt, .jsonl with
--text-field, parquet, Arrow, globs)."""

from __future__ import annotations

import json

import forked
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from capture_support import SENTENCES, save_llama, tiny_llama, write_jsonl
from factory import cli
from hypothesis import given, settings
from hypothesis import strategies as st

import actstore
from actstore.capture import token_origins
from actstore.inputs.data import load_source
from actstore.inputs.packing import doc_tokens, plan_windows
from actstore.verify import verify_store

DOCS = [
    " ".join(SENTENCES[i % len(SENTENCES)] for i in range(k, k + 1 + k % 4)) for k in range(9)
]  # 9 documents of varied length


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("m") / "llama", layers=3)


class _WordTokenizer:
    """A tokenizer stand-in for the property test: one id per word, BOS 1 first, EOS 2 after."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        one = lambda t: [1] + [3 + len(w) for w in t.split()]  # noqa: E731
        return {"input_ids": [one(t) for t in text] if isinstance(text, list) else one(text)}


@settings(deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 40), max_size=12), st.integers(1, 17), st.sampled_from(["pack", "chunk"]))
def test_windows_are_a_bijection_between_corpus_tokens_and_stored_tokens(words, context, mode):
    texts = [" ".join("w" * (1 + (i + j) % 5) for j in range(n)) for i, n in enumerate(words)]
    src = actstore.inputs.data.Source(
        kind="text", name="t", n=len(texts), get=lambda i: {"key": f"d{i}", "text": texts[i]}
    )
    tok = _WordTokenizer()
    win = plan_windows(src, tok, context, mode)
    seen = []  # (document, position) of every stored token, window by window
    for w in range(len(win)):
        runs = win.runs(w)
        n = sum(r[2] for r in runs)
        assert 1 <= n <= context
        if mode == "chunk":
            assert len(runs) == 1
        elif w < len(win) - 1:
            assert n == context  # only the last window of a packed corpus is shorter
        seen += [(d, off + k) for d, off, m in runs for k in range(m)]
    corpus = [(d, k) for d, t in enumerate(texts) for k in range(len(doc_tokens(tok, t)))]
    assert seen == corpus  # every token exactly once, in order


@pytest.mark.slow
def test_packed_store_holds_every_token_once_and_equals_the_model(tmp_path, llama_dir, monkeypatch):
    data = write_jsonl(tmp_path / "c.jsonl", [{"id": f"doc{i}", "body": d} for i, d in enumerate(DOCS)])
    out = tmp_path / "packed"
    cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        data,
        "--text-field",
        "body",
        "--layers",
        "0,1",
        "--pack",
        "--context",
        "16",
        "--batch-size",
        "3",
        "--no-window-bos",
        "--quiet",
    )
    store = actstore.ActStore(out)
    model, tok = tiny_llama(layers=3)
    corpus = [doc_tokens(tok, d) for d in DOCS]
    flat = [t for ids in corpus for t in ids]
    assert len(store) == -(-len(flat) // 16) and store.config.token_ids
    assert [store.lengths(i)["tokens"] for i in range(len(store))] == [16] * (len(store) - 1) + [
        len(flat) - 16 * (len(store) - 1)
    ]
    assert (
        np.concatenate([store.token_ids(i) for i in range(len(store))]).tolist() == flat
    )  # a bijection, in corpus order
    assert store.config.attrs["packing"]["tokens"] == len(flat) and store.config.attrs["packing"]["mode"] == "pack"
    runs = list(store.texts("runs"))
    for i in range(len(store)):
        ids = store.token_ids(i).tolist()
        from_runs = [t for d, key, off, n in runs[i] for t in corpus[d][off : off + n]]
        assert from_runs == ids and all(key == f"doc{d}" for d, key, _, _ in runs[i])
        labels = store.field("tokens_token_labels")[i, : len(ids)]
        assert labels.tolist() == [1 if t in tok.all_special_ids else 0 for t in ids]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (0, 1):  # (the last block's hidden state is after the final norm in HF)
            np.testing.assert_allclose(
                store[i, layer].astype(np.float32), hs[layer + 1][0].numpy(), rtol=2e-3, atol=2e-3
            )
    assert verify_store(out, deep=True).problems == []

    from actstore.capture import runner_local as workers_mod

    bars = []  # the job's one bar counts windows, whose number only the writers know: no total

    class Bar(workers_mod.CaptureBar):
        def __init__(self, total, **kw):
            bars.append(total)
            super().__init__(total, **kw)

    monkeypatch.setattr(workers_mod, "CaptureBar", Bar)
    # Spawned writers: test_capture_cli::test_workers_and_ranks_equal_a_single_writer.
    forked.writers_from_forkserver(monkeypatch)
    two = tmp_path / "two"  # two writers split the windows: the same store
    cli(
        "write",
        two,
        "--model",
        llama_dir,
        "--data",
        data,
        "--text-field",
        "body",
        "--layers",
        "0,1",
        "--pack",
        "--context",
        "16",
        "--batch-size",
        "3",
        "--workers",
        "2",
        "--no-window-bos",
        "--quiet",
    )
    other = actstore.ActStore(two)
    assert len(other) == len(store) and len(other.manifest.shards) == 2 and bars == [None]
    for i in range(len(store)):
        np.testing.assert_array_equal(other[i, 1], store[i, 1])
        assert other.token_ids(i).tolist() == store.token_ids(i).tolist()


def test_chunked_documents_are_cut_not_truncated(tmp_path, llama_dir):
    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(DOCS) + "\n\n", encoding="utf-8")  # one document per line; blank lines skipped
    out = tmp_path / "chunked"
    cli(
        "write",
        out,
        "--model",
        llama_dir,
        "--data",
        txt,
        "--layers",
        "1",
        "--chunk",
        "--context",
        "8",
        "--no-window-bos",
        "--quiet",
    )
    store = actstore.ActStore(out)
    _, tok = tiny_llama(layers=3)
    runs = list(store.texts("runs"))
    per_doc: dict[int, list[int]] = {}
    for i in range(len(store)):
        ((d, key, off, n),) = runs[i]  # one document per window
        assert key == f"line-{d + 1}" and off == len(per_doc.get(d, []))
        per_doc.setdefault(d, []).extend(store.token_ids(i).tolist())
    assert [per_doc[d] for d in range(len(DOCS))] == [doc_tokens(tok, t) for t in DOCS]
    assert store.manifest.truncation["tokens"]["count"] == 0


def test_document_formats(tmp_path):
    rows = [f"document number {i}" for i in range(5)]
    pq.write_table(
        pa.table({"content": rows, "n": list(range(5))}), tmp_path / "c.parquet", row_group_size=2
    )  # read a group at a time
    with pa.ipc.new_file(tmp_path / "c.arrow", pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": rows}))
    for i, r in enumerate(rows):
        (tmp_path / f"doc{i}.txt").write_text(r, encoding="utf-8")
    write_jsonl(tmp_path / "a.jsonl", [{"text": r} for r in rows[:2]])
    write_jsonl(tmp_path / "b.jsonl", [{"text": r} for r in rows[2:]])
    for spec, field in (
        (tmp_path / "c.parquet", "content"),
        (tmp_path / "c.arrow", None),
        (str(tmp_path / "doc*.txt"), None),
        (str(tmp_path / "*.jsonl"), None),
    ):
        src = load_source(str(spec), field)
        assert src.kind == "text" and [src.get(i)["text"] for i in range(len(src))] == rows, spec
    with pytest.raises(
        actstore.capture.DataError,
        match=r"has no column 'body' \(columns: \['content', 'n'\]\); pass --text-field NAME",
    ):
        load_source(str(tmp_path / "c.parquet"), "body")
    with pytest.raises(actstore.capture.DataError, match=r"c\.parquet: column 'n' holds int64, not text"):
        load_source(str(tmp_path / "c.parquet"), "n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"title": "y"}) + "\n")
    with pytest.raises(actstore.capture.DataError, match=r"bad\.jsonl:2: no string field 'body' \(--text-field\)"):
        load_source(str(tmp_path / "bad.jsonl"), "body")
    with pytest.raises(actstore.capture.EmptyDatasetError, match="no file matches"):
        load_source(str(tmp_path / "none*.txt"))
    # datasets' save_to_disk folders (any text column with --text-field) and their own .arrow
    # files (Arrow streams), memory-mapped: nothing is read into memory up front
    import datasets

    datasets.Dataset.from_dict({"body": rows, "n": list(range(5)), "id": [f"d{i}" for i in range(5)]}).save_to_disk(
        tmp_path / "ds"
    )
    src = load_source(str(tmp_path / "ds"), "body")
    assert [src.get(i) for i in (0, 4)] == [{"key": "d0", "text": rows[0]}, {"key": "d4", "text": rows[4]}]
    with pytest.raises(
        actstore.capture.DataError, match=r"ds: column 'n' holds Value\('int64'\), not text; pass --text-field NAME"
    ):
        load_source(str(tmp_path / "ds"), "n")
    with pytest.raises(
        actstore.capture.DataError, match=r"has no column 'text' \(--text-field\); its columns: \['body', 'id', 'n'\]"
    ):
        load_source(str(tmp_path / "ds"), "text")
    with pytest.raises(
        actstore.capture.DataError, match=r"needs an 'image', 'text' or 'prompt' column \(or --text-field NAME\)"
    ):
        load_source(str(tmp_path / "ds"))
    allocated = pa.total_allocated_bytes()
    src = load_source(str(tmp_path / "ds" / "data-00000-of-00001.arrow"), "body")
    assert [src.get(i)["text"] for i in range(len(src))] == rows and pa.total_allocated_bytes() == allocated
    # .jsonl and .txt are streamed: only byte ranges are kept, each record is read when asked for
    src = load_source(str(tmp_path / "a.jsonl"))
    raw = (tmp_path / "a.jsonl").read_bytes()
    (tmp_path / "a.jsonl").write_bytes(raw.replace(b'"text"', b'"TEXT"'))  # same ranges, other contents
    with pytest.raises(
        actstore.capture.DataError, match=r"a\.jsonl record 1: the object has no \"text\" or \"prompt\" string"
    ):
        src.get(1)


def test_packing_options_are_checked_before_the_model_loads(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    for args, message in (
        (["--pack"], "--pack and --chunk need --context N"),
        (["--pack", "--chunk", "--context", "8"], "give --pack (documents concatenated into windows) or --chunk"),
        (["--pack", "--context", "0"], "--context must be a positive int. Got 0."),
        (
            ["--pack", "--context", "8", "--p-max", "4"],
            "--p-max, --r-max, quantiles, --generate and --chat-template do not apply",
        ),
        (["--pack", "--context", "999"], "--context 999 exceeds"),
    ):
        res = cli(
            "write", tmp_path / "s", "--model", llama_dir, "--data", data, "--layers", "1", *args, "--quiet", ok=False
        )
        assert res.exit_code == 1 and message in res.output, (args, res.output)
        assert not (tmp_path / "s").exists()


def test_drop_bos_stores_every_token_but_the_tokenizers_bos(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS[:4]])
    _, tok = tiny_llama(layers=3)
    model, _ = tiny_llama(layers=3)
    out = tmp_path / "texts"
    cli("write", out, "--model", llama_dir, "--data", data, "--layers", "1", "--drop", "bos", "--quiet")
    store = actstore.ActStore(out)
    for i, d in enumerate(DOCS[:4]):
        ids = tok(d)["input_ids"]
        assert ids[0] == tok.bos_token_id and store.token_ids(i).tolist() == ids[1:]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0].numpy()
        np.testing.assert_allclose(
            store[i, 1].astype(np.float32), hs[1:], rtol=2e-3, atol=2e-3
        )  # the model saw the BOS
    packed = tmp_path / "packed"
    cli(
        "write",
        packed,
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--pack",
        "--context",
        "16",
        "--drop",
        "bos",
        "--quiet",
    )
    ps = actstore.ActStore(packed)
    flat = [t for d in DOCS[:4] for t in doc_tokens(tok, d)]
    assert np.concatenate([ps.token_ids(i) for i in range(len(ps))]).tolist() == [
        t for t in flat if t != tok.bos_token_id
    ]
    # the runs describe the stored tokens: each maps back to its document and position
    per_doc = [doc_tokens(tok, d) for d in DOCS[:4]]
    origins = [token_origins(ps, i) for i in range(len(ps))]
    for i, o in enumerate(origins):
        assert [per_doc[d][p] for d, p in o] == ps.token_ids(i).tolist()
    assert sorted(map(tuple, np.concatenate(origins).tolist())) == [
        (d, p) for d in range(4) for p in range(1, len(per_doc[d]))
    ]
    res = cli(
        "write",
        tmp_path / "x",
        "--model",
        llama_dir,
        "--data",
        data,
        "--layers",
        "1",
        "--drop",
        "cls",
        "--quiet",
        ok=False,
    )
    assert (
        res.exit_code == 1
        and "--drop cls leaves out a ViT's CLS token (token 0); --data holds texts (use --drop bos)" in res.output
    )


def test_a_relative_glob_is_recorded_absolute_and_exports_to_saev(tmp_path, llama_dir, monkeypatch):
    (tmp_path / "corpus").mkdir()
    for i, d in enumerate(DOCS[:3]):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(d, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cli(
        "write",
        "s",
        "--model",
        llama_dir,
        "--data",
        "corpus/*.txt",
        "--layers",
        "1",
        "--pack",
        "--context",
        "8",
        "--quiet",
    )
    store = actstore.ActStore(tmp_path / "s")
    assert store.config.attrs["dataset"] == str(tmp_path / "corpus" / "*.txt")
    assert [r[1][1] for r in store.texts("runs")][:1] == ["corpus/d0.txt"]  # run 0: the window's BOS
    res = cli("export-saev", "s", tmp_path / "saev" / "shards", ok=False)  # a text store names no saev family
    assert (
        res.exit_code == 1
        and "a text store ('" in res.output
        and "pass one as a label (--family, e.g. clip" in res.output
    )
    out = cli("export-saev", "s", tmp_path / "saev" / "shards", "--family", "clip", "--quiet").output.strip()
    md = json.loads((tmp_path / "saev" / "shards" / out.rsplit("/", 1)[-1] / "metadata.json").read_text())
    # every content token once; the windows' BOS (token label 1) are left out by the default mask
    content = sum(
        int((store.field("tokens_token_labels")[i, : len(store.token_ids(i))] == 0).sum()) for i in range(len(store))
    )
    assert md["dataset"] == str(tmp_path / "corpus" / "*.txt") and md["n_examples"] == content
    labels = store.field("tokens_token_labels")
    assert all(labels[i, 0] == 1 for i in range(len(store))) and content < sum(
        len(store.token_ids(i)) for i in range(len(store))
    )
