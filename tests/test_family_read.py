"""Aligned families (docs/format.md, section 9) written member by member with ShardWriter:
sites of several widths read by name, finalize and verify of every member, the record's
damage refused with the field named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import actstore
from actstore.errors import (
    AlignmentError,
    CorruptStoreError,
    FormatVersionError,
    LayerNotFoundError,
    StoreMismatchError,
    StoreNotFoundError,
    VerificationError,
)
from actstore.layout.family import FAMILY_FILE, Family, Member
from actstore.read.family import FamilyStore
from actstore.read.info import format_info, store_info
from actstore.verify import verify_store
from actstore.write.family import create_family

N, T = 6, 5
SITES_D8 = ("blocks.2.hook_mlp_in", "blocks.2.hook_mlp_out")
SITE_D12 = "blocks.2.mlp.hook_post"


def _family() -> Family:
    return Family(
        (
            Member(name="d8", model=0, model_id="toy", sites=SITES_D8, width=8),
            Member(name="d12", model=0, model_id="toy", sites=(SITE_D12,), width=12),
        )
    )


def _write_member(path, names: dict[int, str], d: int, acts: np.ndarray, ids: np.ndarray) -> None:
    with actstore.ShardWriter(
        path,
        layers=sorted(names),
        d_model=d,
        tokens=T,
        token_ids=True,
        dtype="float32",
        model_id="toy",
        attrs={"hook_names": {str(k): v for k, v in names.items()}},
    ) as w:
        w.append(acts, token_ids=ids)


@pytest.fixture
def family(tmp_path):
    """A finalized family of two members (widths 8 and 12) and the arrays written into it."""
    rng = np.random.default_rng(0)
    root = tmp_path / "fam"
    ids = rng.integers(0, 500, (N, T))
    a8 = rng.standard_normal((N, 2, T, 8)).astype(np.float32)
    a12 = rng.standard_normal((N, 1, T, 12)).astype(np.float32)
    create_family(root, _family())
    _write_member(root / "members" / "d8", {0: SITES_D8[0], 1: SITES_D8[1]}, 8, a8, ids)
    _write_member(root / "members" / "d12", {0: SITE_D12}, 12, a12, ids)
    manifests = actstore.finalize(root)
    assert [m.n_examples for m in manifests] == [N, N]
    return root, a8, a12, ids


def test_each_site_reads_at_its_own_width(family):
    root, a8, a12, ids = family
    fam = actstore.open(root)
    assert isinstance(fam, FamilyStore) and len(fam) == N
    for ex in (0, N - 1):
        np.testing.assert_array_equal(fam[ex, SITES_D8[0]], a8[ex, 0])
        np.testing.assert_array_equal(fam[ex, SITES_D8[1]], a8[ex, 1])
        np.testing.assert_array_equal(fam[ex, SITE_D12], a12[ex, 0])
        np.testing.assert_array_equal(fam[ex, (0, SITE_D12)], a12[ex, 0])
        np.testing.assert_array_equal(fam.token_ids(ex), ids[ex])
    assert fam[0, SITE_D12].shape == (T, 12)
    fam.check_aligned()
    with pytest.raises(
        StoreNotFoundError,
        match=r"is an aligned family of stores \(family.json\), not one store; open it with actstore.open",
    ):
        actstore.ActStore(root)
    # A member is an ordinary store: every existing reader opens it as it is.
    member = actstore.ActStore(root / "members" / "d12")
    np.testing.assert_array_equal(member[3, "blocks.2.mlp.hook_post"], a12[3, 0])


def test_unknown_sites_and_models_are_named(family):
    fam = actstore.open(family[0])
    with pytest.raises(LayerNotFoundError, match=r"no site 'blocks.9.hook_mlp_out' in this family; it holds \["):
        fam[0, "blocks.9.hook_mlp_out"]
    with pytest.raises(LayerNotFoundError, match=r"model 1 does not exist: this family has models 0..0"):
        fam[0, (1, SITE_D12)]
    with pytest.raises(LayerNotFoundError, match=r"no model 'other' in this family; its models are \['toy'\]"):
        fam[0, ("other", SITE_D12)]


def test_to_xarray_has_a_variable_per_member_with_its_own_width(family):
    root, a8, a12, _ = family
    ds = actstore.open(root).to_xarray()
    assert ds["activations_d8"].dims == ("example", "d8_layer", "token", "d8_d_model")
    assert ds["activations_d12"].shape == (N, 1, T, 12)
    np.testing.assert_array_equal(ds["activations_d12"].values, a12)
    np.testing.assert_array_equal(ds["activations_d8"].isel(example=2).values, a8[2])
    assert list(ds["d8_site"].values) == list(SITES_D8)
    assert [m["name"] for m in ds.attrs["family"]] == ["d8", "d12"]


def test_verify_and_info_cover_every_member(family):
    root = family[0]
    assert verify_store(root).ok
    info = store_info(root, sinks=False)
    assert [(m["member"], m["width"], m["sites"]) for m in info["family"]] == [
        ("d8", 8, list(SITES_D8)),
        ("d12", 12, [SITE_D12]),
    ]
    text = format_info(info)
    assert f"site {SITE_D12:<44} width 12, layer 0" in text
    assert "examples     6 (every member holds the same examples and tokens)" in text
    # Damage in a member is reported under its folder.
    (chunk,) = [p for p in (root / "members" / "d12").rglob("*") if p.is_file() and "tokens_activations/c" in str(p)]
    chunk.write_bytes(chunk.read_bytes()[:-8])  # a chunk file cut short
    report = verify_store(root)
    assert not report.ok
    assert all(p.path.startswith("members/d12/") for p in report.errors)
    assert report.errors[0].message.startswith("member d12: ")


def test_misaligned_members_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "fam"
    ids = rng.integers(0, 500, (N, T))
    create_family(root, _family())
    _write_member(root / "members" / "d8", {0: SITES_D8[0], 1: SITES_D8[1]}, 8, np.zeros((N, 2, T, 8), np.float32), ids)
    _write_member(root / "members" / "d12", {0: SITE_D12}, 12, np.zeros((N - 1, 1, T, 12), np.float32), ids[:-1])
    with pytest.raises(AlignmentError, match=r"hold different examples per shard \{'d8': \[6\], 'd12': \[5\]\}"):
        actstore.finalize(root)
    with pytest.raises(AlignmentError, match=r"hold different numbers of examples \{'d8': 6, 'd12': 5\}"):
        actstore.open(root)
    assert any(p.kind == "alignment" for p in verify_store(root).errors)
    # Same counts, other tokens: check_aligned names the first example that differs.
    shutil.rmtree(root / "members" / "d12")
    other = ids.copy()
    other[4, 2] += 1
    _write_member(root / "members" / "d12", {0: SITE_D12}, 12, np.zeros((N, 1, T, 12), np.float32), other)
    actstore.finalize(root)
    with pytest.raises(AlignmentError, match=r"members d8 and d12 differ in token ids at example 4"):
        actstore.open(root).check_aligned()


def test_the_record_is_checked(tmp_path):
    root = tmp_path / "fam"
    create_family(root, _family())
    with pytest.raises(StoreMismatchError, match=r"holds a family already; pass resume=True"):
        create_family(root, _family())
    assert create_family(root, _family(), resume=True).exists(FAMILY_FILE)
    doc = json.loads((root / FAMILY_FILE).read_text())
    assert list(doc) == ["format", "format_version", "members"]
    for change, error, message in (
        ({"format_version": 2}, FormatVersionError, r"family format_version 2; this actstore reads 1"),
        ({"members": [{**doc["members"][0], "name": "../x"}]}, CorruptStoreError, r"member names must match"),
        (
            {"members": [doc["members"][0], {**doc["members"][1], "sites": list(SITES_D8)}]},
            CorruptStoreError,
            r"each site of a model must be in exactly one member",
        ),
        (
            {"members": [{**doc["members"][0], "width": "8"}]},
            CorruptStoreError,
            r"member 0 has a field of the wrong type",
        ),
    ):
        (root / FAMILY_FILE).write_text(json.dumps({**doc, **change}))
        with pytest.raises(error, match=message):
            FamilyStore(root, open_member=actstore.ActStore)
    plain = tmp_path / "plain"
    _write_member(plain, {0: SITE_D12}, 12, np.zeros((N, 1, T, 12), np.float32), np.zeros((N, T), int))
    with pytest.raises(StoreMismatchError, match=r"holds an ordinary store; write a family"):
        create_family(plain, _family())


def test_the_format_document_lists_the_record_fields():
    from test_format_doc import _table_fields

    from actstore.layout.family import FAMILY_FIELDS, MEMBER_FIELDS

    assert _table_fields("family.json (written once") == list(FAMILY_FIELDS)
    assert _table_fields("Each entry of `members`") == list(MEMBER_FIELDS)


def test_export_saev_takes_one_width_a_run(family, tmp_path):
    root, _, a12, _ = family
    opts = {"cls": "none", "family": "dinov2", "dataset": str(tmp_path)}
    out = actstore.export_saev(root, dump_to=tmp_path / "saev", layers=[SITE_D12], **opts)
    saev = actstore.open(out.path)
    assert saev.d_model == 12 and len(saev) == N and list(saev.layers) == [0]
    np.testing.assert_array_equal(saev[1, 0], a12[1, 0].astype(saev[1, 0].dtype))
    with pytest.raises(
        LayerNotFoundError, match=r"width 8, 'blocks.2.mlp.hook_post': width 12\): export one width a run"
    ):
        actstore.export_saev(root, dump_to=tmp_path / "saev2", layers=[SITES_D8[0], SITE_D12], **opts)


@pytest.mark.torch  # the SAELens export streams through actstore.loaders
def test_export_saelens_takes_a_site(family, tmp_path):
    from actstore.saelens import export_saelens

    root, a8, _, _ = family
    res = export_saelens(root, tmp_path / "sl", layer=SITES_D8[1], context_size=T, progress=False)
    assert res.d_in == 8 and res.hook_name == SITES_D8[1] and res.n_tokens == N * T
    with pytest.raises(LayerNotFoundError, match=r"no site 'blocks.3.hook_mlp_out' in this family"):
        export_saelens(root, tmp_path / "sl2", layer="blocks.3.hook_mlp_out", progress=False)


def test_export_saev_command_names_the_widths(family, tmp_path):
    from factory import cli

    root = family[0]
    args = (tmp_path / "saev", "--cls", "none", "--family", "dinov2", "--dataset", tmp_path, "--quiet")
    res = cli("export-saev", root, "--layers", SITE_D12, *args)
    assert actstore.open(res.output.strip().splitlines()[-1]).d_model == 12
    res = cli("export-saev", root, "--layers", f"{SITES_D8[1]},{SITE_D12}", *args, ok=False)
    assert res.exit_code == 1
    assert "'blocks.2.hook_mlp_out': width 8, 'blocks.2.mlp.hook_post': width 12): export one width a run" in res.output


def test_open_verifies_every_member_and_a_family_pickles(family):
    import pickle

    root, _, a12, _ = family
    fam = actstore.open(root, verify="deep")
    assert isinstance(fam, FamilyStore)
    again = pickle.loads(pickle.dumps(fam))
    np.testing.assert_array_equal(again[2, SITE_D12], a12[2, 0])
    (chunk,) = [p for p in (root / "members" / "d8").rglob("*") if p.is_file() and "tokens_activations/c" in str(p)]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF  # one flipped byte in member d8
    chunk.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match=r"members/d8 failed verification \(deep\)"):
        actstore.open(root, verify="deep")


@pytest.mark.dev  # the feature pass writes parquet tables (pyarrow)
def test_features_take_a_site(family, tmp_path):
    from actstore.features.run import run_features

    root = family[0]
    meta = run_features(root, SITE_D12, str(tmp_path / "feats"), neurons=True, device="cpu")
    assert meta["n_features"] == 12 and meta["layer"] == 0 and meta["n_tokens"] == N * T
    with pytest.raises(LayerNotFoundError, match=r"width 8, 'blocks.2.mlp.hook_post': width 12\): run one site a pass"):
        run_features(root, [SITES_D8[0], SITE_D12], str(tmp_path / "feats2"), neurons=True, device="cpu")
