"""Everything about the data and the layers is checked before a model loads (issue 23 items
3 and 4): a file that does not decode, in a glob or alone, fails in the preflight naming the
file and the options; --encoding reads other encodings and --errors replace|skip goes on,
with counts; a misspelled TransformerLens hook name gets the closest names."""

from __future__ import annotations

import pytest
from capture_support import SENTENCES, save_llama, tiny_llama
from factory import cli

import actstore
from actstore.capture import run as run_mod

LATIN = "caf\u00e9 na\u00efve d\u00e9j\u00e0 vu"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("m") / "llama", layers=2)


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, s in enumerate(SENTENCES[:3]):
        (folder / f"d{i}.txt").write_text(s, encoding="utf-8")
    (folder / "d3.txt").write_bytes(LATIN.encode("latin-1"))  # not UTF-8
    return folder


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(run_mod, "load_model", refuse)


def test_an_undecodable_file_in_a_glob_fails_before_the_model_loads(tmp_path, corpus, llama_dir, no_model):
    res = cli(
        "write", tmp_path / "s", "--model", llama_dir, "--data", f"{corpus}/*.txt", "--layers", "1", "--quiet", ok=False
    )
    assert res.exit_code == 1
    assert (
        f"{corpus / 'd3.txt'}: not utf-8 text" in res.output
        and "--encoding" in res.output
        and "--errors replace|skip" in res.output
    )
    assert not (tmp_path / "s").exists()


def test_a_txt_file_with_an_undecodable_line_names_the_line(tmp_path, llama_dir, no_model):
    f = tmp_path / "lines.txt"
    f.write_bytes(b"one line\n" + LATIN.encode("latin-1") + b"\nthree\n")
    res = cli("write", tmp_path / "s", "--model", llama_dir, "--data", f, "--layers", "1", "--quiet", ok=False)
    assert res.exit_code == 1 and f"{f}:2: not utf-8 text" in res.output


def test_encoding_reads_latin1_and_errors_replace_or_skip_go_on_with_counts(tmp_path, corpus, llama_dir):
    _, tok = tiny_llama(layers=2)
    cli(
        "write",
        tmp_path / "latin",
        "--model",
        llama_dir,
        "--data",
        f"{corpus}/d3.txt",
        "--layers",
        "1",
        "--encoding",
        "latin-1",
        "--quiet",
    )
    st = actstore.ActStore(tmp_path / "latin")
    assert st.token_ids(0).tolist() == tok(LATIN)["input_ids"]
    res = cli(
        "write",
        tmp_path / "skip",
        "--model",
        llama_dir,
        "--data",
        f"{corpus}/*.txt",
        "--layers",
        "1",
        "--errors",
        "skip",
    )
    assert "--errors skip: 1 of 4 documents not decodable as utf-8 were left out" in res.output
    assert len(actstore.ActStore(tmp_path / "skip")) == 3
    res = cli(
        "write",
        tmp_path / "rep",
        "--model",
        llama_dir,
        "--data",
        f"{corpus}/*.txt",
        "--layers",
        "1",
        "--errors",
        "replace",
    )
    assert "--errors replace: undecodable bytes replaced (U+FFFD) in 1 of 4 documents" in res.output
    assert len(actstore.ActStore(tmp_path / "rep")) == 4
    res = cli(
        "write",
        tmp_path / "x",
        "--model",
        llama_dir,
        "--data",
        f"{corpus}/*.txt",
        "--layers",
        "1",
        "--encoding",
        "klingon",
        "--quiet",
        ok=False,
    )
    assert res.exit_code == 1 and "--encoding 'klingon' is not an encoding Python knows" in res.output


@pytest.mark.parametrize(
    "layer,hint",
    [
        ("blocks.1.hook_resid_pots", "did you mean 'blocks.1.hook_resid_post'"),
        ("blocks.1.hook_mlp", "did you mean 'blocks.1.hook_mlp_in' or 'blocks.1.hook_mlp_out'"),
    ],
)
def test_a_misspelled_hook_name_is_refused_before_the_model_loads_with_the_closest(
    tmp_path, llama_dir, layer, hint, no_model
):
    data = tmp_path / "t.txt"
    data.write_text("the capital of france is paris\n", encoding="utf-8")
    res = cli("write", tmp_path / "s", "--model", llama_dir, "--data", data, "--layers", layer, "--quiet", ok=False)
    assert res.exit_code == 1 and f"{layer!r} is not a hook name" in res.output and hint in res.output
