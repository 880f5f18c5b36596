"""One layer parser for every command and API (issue 23 items 6 and 12): stored numbers,
negative numbers (counted from the end of the stored layers), TransformerLens names and
module paths, in store[...], show --layer, export-saev --layers and export-saelens --layer;
a misspelled name gets the closest ones; a non-integer is refused, never truncated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from capture_support import make_images, save_dinov2
from factory import cli

import actstore
from actstore.errors import LayerNotFoundError


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    make_images(root / "imgs", 3)
    cli(
        "write",
        root / "s",
        "--model",
        save_dinov2(root / "dino"),
        "--data",
        root / "imgs",
        "--layers",
        "0,2",
        "--quiet",
    )
    return actstore.ActStore(root / "s")


@pytest.mark.parametrize("name", [-1, "blocks.2.hook_resid_post", "encoder.layer.2", np.int64(2), np.int64(-1)])
def test_store_reads_a_layer_by_any_of_its_names(vit, name):
    np.testing.assert_array_equal(vit[1, name], vit[1, 2])
    assert vit.layer_number(name) == 2


def test_lists_mix_names_and_numbers(vit):
    got = vit[0, ["blocks.0.hook_resid_post", -1]]
    np.testing.assert_array_equal(got[0], vit[0, 0])
    np.testing.assert_array_equal(got[1], vit[0, 2])


@pytest.mark.parametrize(
    "bad,message",
    [
        (
            1.5,
            r"layer 1.5 is not a layer: give a stored layer number \(an int\), a negative number counting from the last stored layer, or a name",
        ),
        (2.0, r"layer 2.0 is not a layer: give a stored layer number \(an int\)"),
        (True, "layer True is not a layer"),
        (-3, r"layer -3 is not stored; this store holds layers \[0, 2\] \(-1 to -2 count back from the last\)"),
        (
            "blocks.2.hook_resid_pots",
            r"no stored layer is named 'blocks.2.hook_resid_pots'; did you mean 'blocks.2.hook_resid_post'",
        ),
    ],
)
def test_bad_layers_are_refused_never_truncated(vit, bad, message):
    with pytest.raises(LayerNotFoundError, match=message):
        vit[0, bad]


def test_show_takes_negative_numbers_and_names(vit, tmp_path):
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    cli("show", vit.path, "--ex", "0", "--layer", "2", "-o", a)
    cli("show", vit.path, "--ex", "0", "--layer", "-1", "-o", b)
    cli("show", vit.path, "--ex", "0", "--layer", "blocks.2.hook_resid_post", "-o", c)
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()
    res = cli("show", vit.path, "--ex", "0", "--layer", "blocks.2.hook_resid_pots", ok=False)
    assert res.exit_code == 1 and "did you mean 'blocks.2.hook_resid_post'" in res.output


def test_export_saev_layers_take_names_and_negative_numbers(vit, tmp_path):
    out = (
        cli("export-saev", vit.path, tmp_path / "d", "--layers", "blocks.0.hook_resid_post,-1", "--quiet")
        .output.strip()
        .splitlines()[-1]
    )
    assert json.loads((Path(out) / "metadata.json").read_text())["layers"] == [0, 2]


def test_loaders_take_the_same_layers(vit):
    from actstore.loaders.pairs import PairDataset
    from actstore.loaders.tokens import TokenStream

    assert TokenStream(vit, layers=[-1, "blocks.0.hook_resid_post"]).layers == (2, 0)
    assert PairDataset(vit, layers="encoder.layer.2").layers == (2,)
    with pytest.raises(LayerNotFoundError, match="did you mean 'encoder.layer.2'"):
        TokenStream(vit, layers=["encoder.layer.3"])
