"""Every argument gets the project's own clear error (issue 23 item 12): non-integer layer
numbers and example indices are refused, never truncated; a huge integer on the command
line is a one-line error, not an OverflowError traceback or a hang; a store path that is a
regular file is named as such."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from factory import vit_store

import actstore
from actstore.cli import main
from actstore.errors import ActstoreError, ExampleIndexError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return vit_store(tmp_path_factory.mktemp("a") / "s")


@pytest.mark.parametrize("layers", [[0, 1.5], [0, 2.0], [True, 1], ["1", 2]])
def test_writer_layers_must_be_ints(tmp_path, layers):
    with pytest.raises(ValueError, match=r"layers must be a list of model layer numbers \(ints\)"):
        actstore.ShardWriter(tmp_path / "s", layers=layers, d_model=4, tokens=3)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("call", ["lengths", "token_ids", "sample"])
@pytest.mark.parametrize("ex", [1.5, 2.0, True, "1"])
def test_example_indices_must_be_ints(store, call, ex):
    with pytest.raises(ExampleIndexError, match=r"example index must be an int \(negative counts from the end\); got"):
        getattr(store, call)(ex)


def test_a_store_path_that_is_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ActstoreError, match=rf"{f} is a file, not a store folder: choose another path"):
        actstore.ShardWriter(f, layers=[0], d_model=4, tokens=3)
    assert f.read_text() == "x"  # nothing written over it


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["export-saev", "{s}", "{d}", "--patches-per-shard", str(10**30)],
            "--patches-per-shard: 1000000000000000000000000000000 is too large",
        ),
        (
            ["export-saev", "{s}", "{d}", "--workers", str(10**30)],
            "--workers: 1000000000000000000000000000000 is too large (at most 256)",
        ),
        (["export-saev", "{s}", "{d}", "--workers", "100000"], "--workers: 100000 is too large (at most 256)"),
        (
            ["export-saelens", "{s}", "{d}", "--layer", "2", "--context-size", str(2**70)],
            "--context-size: 1180591620717411303424 is too large",
        ),
        (["show", "{s}", "--ex", str(10**30), "--layer", "2"], "--ex: 1000000000000000000000000000000 is too large"),
    ],
)
def test_huge_integers_on_the_command_line_are_one_line_errors(store, tmp_path, args, message):
    res = CliRunner().invoke(main, [a.format(s=store.path, d=tmp_path / "d") for a in args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not isinstance(res.exception, OverflowError)


def test_reads_are_unchanged_by_the_checks(store):
    np.testing.assert_array_equal(store[np.int64(1), 2], store[1, 2])
    assert store.lengths(np.int64(-1)) == store.lengths(len(store) - 1)
