"""The CLI grammar at work along a workflow on a word store (a tokenizer, token ids, a BOS
labelled special): --json prints one JSON document and --quiet nothing at every step, an
existing output is refused unless --overwrite, old spellings of the views' options warn and
give today's result. tests/test_cli_grammar.py checks every command's parameters."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from factory import word_store, word_tokenizer

import actstore
from actstore.cli import main

pytestmark = pytest.mark.torch  # the word store's tokenizer is a transformers one


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    tok = word_tokenizer(root / "tok")
    return word_store(root / "store", tok)


def run(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, res.output
    return res


def test_json_and_quiet_along_a_whole_workflow(store, tmp_path):
    """Every step prints one JSON document with --json, and nothing with --quiet."""
    feats, site, npd = tmp_path / "feats", tmp_path / "site", tmp_path / "np"
    steps = [
        ("info", store),
        ("verify", store),
        ("features", store, "--layer", "4", "--neurons", "--top-k", "3", "--out", feats),
        ("view", feats, "--out", site),
        ("export-neuronpedia", feats, "--out", npd),
        ("show", store, "--ex", "2", "--layer", "-1", "--out", tmp_path / "ex2.html"),
        ("export-pkl", store, "--out", tmp_path / "pkl"),
        ("import-pkl", tmp_path / "pkl", tmp_path / "back"),
        ("cp", store, tmp_path / "copy"),
        ("finalize", tmp_path / "copy"),
    ]
    answers = {}
    for step in steps:
        res = run(*step, "--json")
        answers[step[0]] = json.loads(res.stdout)
        assert "actstore:" not in res.stderr, (step[0], res.stderr)  # (progress lines may go there)
    assert answers["features"] == {"path": str(feats), "features": 6, "tokens": 96}  # BOS left out: 12 x 8
    assert answers["view"] == {"path": str(site / "index.html")} and (site / "index.html").exists()
    page = (tmp_path / "ex2.html").read_text()
    drawn = actstore.ActStore(store).manifest_sha256  # the state the page was drawn from, recorded
    assert answers["show"] == {"path": str(tmp_path / "ex2.html"), "manifest_sha256": drawn}
    assert (
        "zebra" in page
        and "<title>example 2<" in page
        and f'<meta name="actstore:manifest_sha256" content="{drawn}">' in page
    )
    assert answers["export-neuronpedia"]["path"] == str(npd) and len(answers["export-neuronpedia"]["files"]) >= 1
    assert answers["import-pkl"]["n_examples"] == 12 and answers["finalize"]["examples"] == 12
    quiet = [
        ("features", store, "--layer", "4", "--neurons", "--top-k", "3", "-o", tmp_path / "f2"),
        ("view", tmp_path / "f2", "-o", tmp_path / "s2"),
        ("export-neuronpedia", tmp_path / "f2", "-o", tmp_path / "np2"),
        ("show", store, "--ex", "0", "--layer", "4", "-o", tmp_path / "ex0.html"),
    ]
    for step in quiet:
        assert run(*step, "--quiet").output == "", step[0]


@pytest.mark.parametrize(
    "args",
    [
        ["features", "{s}", "--layer", "4", "--neurons", "--out", "{o}"],
        ["view", "{f}", "--out", "{o}"],
        ["export-neuronpedia", "{f}", "--out", "{o}"],
        ["show", "{s}", "--ex", "2", "--layer", "4", "--out", "{o}/page.html"],
    ],
    ids=lambda v: v[0],
)
def test_an_existing_output_is_refused_unless_overwrite(store, tmp_path, args):
    feats = tmp_path / "feats"
    run("features", store, "--layer", "4", "--neurons", "--top-k", "2", "-o", feats, "--quiet")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    (out / "page.html").write_text("an older page")
    given = [a.format(s=store, f=feats, o=out) for a in args]
    target = out / "page.html" if args[0] == "show" else out
    res = run(*given, code=1)
    assert res.output == (
        f"actstore: error: {target} exists; pass --overwrite to replace it, or choose another --out "
        "(nothing was written)\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt", "page.html"]
    assert (out / "page.html").read_text() == "an older page"
    run(*given, "--overwrite", "--quiet")
    made = {"features": "meta.json", "view": "index.html", "export-neuronpedia": "batch-0.json", "show": "page.html"}
    assert (out / made[args[0]]).exists()
    if args[0] == "show":
        assert "zebra" in (out / "page.html").read_text()


def test_old_feature_spellings_warn_and_give_todays_result(store, tmp_path):
    """Each old spelling gives today's result and one warning naming today's spelling."""
    keep = run("features", store, "--layer", "4", "--neurons", "-o", tmp_path / "k", "--keep-special", "--no-progress")
    assert keep.stderr == (
        "actstore: warning: --keep-special is deprecated; use --special keep\n"
        "actstore: warning: --no-progress is deprecated; use --quiet\n"
    )
    new = run("features", store, "--layer", "4", "--neurons", "-o", tmp_path / "n", "--special", "keep", "--quiet")
    assert new.output == ""
    meta_old, meta_new = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("k", "n"))
    assert meta_old["n_tokens"] == meta_new["n_tokens"] == 12 * 9  # the BOS kept: every token
    assert "--special keep" in meta_new["command"] and "--special keep" in meta_old["command"]
