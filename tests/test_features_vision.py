"""`actstore view` of a ViT store: each image is written once as a thumbnail, a feature's
per-patch activations are data in its record (equal to the store's activations), rows name
the image and the patch, and the page draws the heatmaps on canvases in a real headless
browser (Debian's chromium), checked pixel by pixel in a screenshot."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from browser import _browser, _chromium, site_record
from click.testing import CliRunner
from factory import image_store

import actstore
from actstore.cli import main
from actstore.features.run import run_features
from actstore.features.views.site import build_site

pytestmark = pytest.mark.torch  # Pillow, transformers' tokenizers and chromium (the dev install)

D = 6  # image_store's d_model
GRID, PREFIX = 3, 1  # image_store: 1 CLS + 3x3 patches of a 28-pixel image


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """The store, its neurons' pass (top 2) and the site with 84-pixel thumbnails."""
    root = tmp_path_factory.mktemp("vit")
    store = image_store(root / "store", root, d_model=D)
    run_features(store, 11, str(root / "feat"), neurons=True, top_k=2)
    site = build_site(str(root / "feat"), root / "site", thumb_size=84).parent
    return store, root / "feat", site


def _grids(rec):
    """(images, n_patches) float32 patch values of a record, from its dense or sparse form."""
    n = len(rec["images"])
    out = np.zeros((n, GRID * GRID), np.float32)
    if "pi" in rec:
        out.reshape(-1)[rec["pi"]] = rec["pv"]
    else:
        out[:] = rec["pv"].reshape(n, GRID * GRID)
    return out


def test_patch_values_are_the_stored_activations(vit):
    store_path, _, site = vit
    store = actstore.open(store_path)
    keys = store.field("sample_key")
    for f in range(D):
        rec = site_record(site, f)
        assert "pi" not in rec  # a neuron is non-zero on every patch: the dense form is smaller
        grids = _grids(rec)
        exs = sorted(set(rec["rows"]["ex"]))
        assert [name for _, name in rec["images"]] == [str(keys[e]) for e in exs]  # one per distinct example
        for k, ex in enumerate(exs):
            want = np.asarray(store[ex, 11], np.float32)[PREFIX:, f]  # float16 in the store: exact
            np.testing.assert_array_equal(grids[k], want)
        for r, ex in enumerate(rec["rows"]["ex"]):  # each row points at its example's image
            assert exs[rec["rows"]["im"][r]] == ex


def _sae(folder, F):
    """An SAELens folder of a ReLU SAE whose bias keeps most patches at 0; (folder, W_enc, b_enc)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    W = rng.standard_normal((D, F)).astype(np.float32)
    b = np.full(F, -1.5, np.float32)
    folder.mkdir()
    save_file(
        {"W_enc": W, "b_enc": b, "W_dec": np.ascontiguousarray(W.T), "b_dec": np.zeros(D, np.float32)},
        folder / "sae_weights.safetensors",
    )
    (folder / "cfg.json").write_text(
        json.dumps({"architecture": "standard", "d_in": D, "d_sae": F, "dtype": "float32"})
    )
    return folder, W, b


def test_sparse_patch_values_of_an_sae(vit, tmp_path):
    """A ReLU SAE is zero on most patches: only the non-zero values are written, and they are
    float16 of relu(x W_enc + b_enc), computed here with numpy."""
    store_path, _, _ = vit
    F = 16
    sae, W, b = _sae(tmp_path / "sae", F)
    run_features(store_path, 11, str(tmp_path / "feat"), sae=str(sae), top_k=3, per_interval=0)
    site = build_site(str(tmp_path / "feat"), tmp_path / "site", plot_examples=0).parent
    store = actstore.open(store_path)
    n_sparse = 0
    for f in range(F):
        rec = site_record(site, f)
        if not rec["rows"]["ex"]:
            continue
        n_sparse += "pi" in rec
        grids = _grids(rec)
        for k, ex in enumerate(sorted(set(rec["rows"]["ex"]))):
            x = np.asarray(store[ex, 11], np.float32)[PREFIX:]
            want = np.maximum(x @ W[:, f] + b[f], 0).astype(np.float16).astype(np.float32)
            np.testing.assert_allclose(grids[k], want, rtol=0, atol=float(np.abs(want).max()) * 2**-10)
    assert n_sparse > 0


def test_each_image_is_written_once(tmp_path):
    """Examples that share an image reference share its thumbnail; the thumbnail is the image
    as the model saw it (centre-cropped), at --thumb-size pixels."""
    from PIL import Image

    from actstore.features.views.context import image_pixels

    rng = np.random.default_rng(3)
    refs = []
    yy, xx = np.mgrid[0:40, 0:30]
    for i in range(3):  # smooth and distinct (JPEG keeps them within a few levels)
        p = tmp_path / f"pic{i}.png"
        rgb = (
            np.stack([xx * 8, yy * 6, np.full_like(xx, 80 * i)], axis=2)
            if i != 1
            else np.stack([255 - yy * 6, xx * 8, yy * 3], axis=2)
        )
        Image.fromarray(rgb.astype(np.uint8)).save(p)
        refs.append({"path": str(p)})
    refs = [refs[0], refs[1], refs[0], refs[2], refs[1], {"embedded": "skimage:camera"}]  # 4 distinct images
    x = rng.standard_normal((len(refs), 1, 10, D)).astype(np.float16)
    path = tmp_path / "store"
    with actstore.ShardWriter(
        path,
        layers=[11],
        d_model=D,
        tokens=10,
        texts=("image",),
        attrs={"image": {"size": 28, "patch_size": 14, "grid": [3, 3], "prefix_tokens": 1}},
    ) as w:
        w.append(x, texts={"image": refs}, sample_keys=["", "b", "", "d", "e", ""])
    actstore.finalize(path)
    run_features(path, 11, str(tmp_path / "feat"), neurons=True, top_k=6)
    res = CliRunner().invoke(
        main, ["view", str(tmp_path / "feat"), "--out", str(tmp_path / "site"), "--thumb-size", "56", "--quiet"]
    )
    assert res.exit_code == 0, res.output
    site = tmp_path / "site"
    files = sorted(p.relative_to(site).as_posix() for p in (site / "img").rglob("*") if p.is_file())
    assert files == ["img/0/0.jpg", "img/0/1.jpg", "img/0/2.jpg", "img/0/3.jpg"]
    rec = site_record(site, 0)
    assert len(set(rec["rows"]["ex"])) == 6  # every example is among feature 0's rows
    by_ex = dict(zip(sorted(set(rec["rows"]["ex"])), rec["images"]))
    # file numbers follow the references; names: the sample key, else the file's or embedded name
    assert by_ex == {
        0: [0, "pic0.png"],
        1: [1, "b"],
        2: [0, "pic0.png"],
        3: [2, "d"],
        4: [1, "e"],
        5: [3, "skimage:camera"],
    }
    store = actstore.open(path)
    want = {
        ex: np.asarray(Image.fromarray(image_pixels(store, ex, 28)).resize((56, 56), Image.BICUBIC), np.float32)
        for ex in (0, 1, 3, 5)
    }
    for ex in want:
        thumb = np.asarray(Image.open(site / f"img/0/{by_ex[ex][0]}.jpg").convert("RGB"), np.float32)
        err = {other: np.abs(thumb - w).mean() for other, w in want.items()}
        assert thumb.shape == (56, 56, 3) and err[ex] < 4 and min(v for o, v in err.items() if o != ex) > 20
    res = CliRunner().invoke(main, ["view", str(tmp_path / "feat"), "--out", str(tmp_path / "s2"), "--thumb-size", "8"])
    assert res.exit_code == 1 and "--thumb-size must be an int in [16, 1024] pixels. Got 8." in res.output
    assert not (tmp_path / "s2").exists()


def test_rows_name_the_image_and_the_patch(vit):
    _, _, site = vit
    index = (site / "data" / "index.js").read_text()
    value = json.loads(index[len('ACTSTORE.load("index",') : -3])
    # feature 1's top activation: example 1 ("im1"), patch (1, 2); feature 0's: the embedded camera, (0, 0)
    assert value["text"][1] == ["", "im1", " (1, 2)"] and value["text"][0] == ["", "im4", " (0, 0)"]
    meta = json.loads((site / "data" / "meta.js").read_text()[len('ACTSTORE.load("meta",') : -3])
    assert meta["image"] == {"grid": [3, 3], "prefix": 1, "cls": False, "thumb": 84, "bucket": 1000, "n_images": 5}


def _box(dom, name):
    """(x, y, w, h) of the canvas whose card names image `name` (the page records it)."""
    m = re.search(
        r'<canvas class="heat"[^>]*data-box="(\d+),(\d+),(\d+),(\d+)"[^>]*></canvas><figcaption><b class="iname"[^>]*>'
        + name
        + "<",
        dom,
    )
    assert m, f"no drawn canvas for {name}"
    return tuple(int(v) for v in m.groups())


def test_feature_page_draws_heatmaps_on_canvases(vit, tmp_path):
    """Feature 1 fires 9.0 on example 1's patch (1, 2): on the page that patch is orange over
    the thumbnail (alpha 0.85 at the feature's max) and outlined in green; a patch near 0 shows
    the thumbnail as it is."""
    from PIL import Image

    _, _, site = vit
    exe = _chromium()
    url = (site / "feature.html").as_uri() + "#1"
    dom = _browser(
        exe, tmp_path / "prof", "--window-size=1200,2400", "--virtual-time-budget=5000", "--dump-dom", url=url
    )
    n_canvas = dom.count('<canvas class="heat"')
    assert n_canvas >= 2 and f'data-drawn="{n_canvas}"' in dom and dom.count('data-drawn="1"') == n_canvas
    assert "<b " in dom and ">im1</b>" in dom and '<span class="prow">#0 (1, 2) 9</span>' in dom
    shot = tmp_path / "page.png"
    _browser(
        exe, tmp_path / "prof", f"--screenshot={shot}", "--window-size=1200,2400", "--virtual-time-budget=5000", url=url
    )
    page = np.asarray(Image.open(shot).convert("RGB"), np.float32)
    x, y, w, h = _box(dom, "im1")
    assert (w, h) == (84, 84)
    rec = site_record(site, 1)
    k = [name for _, name in rec["images"]].index("im1")
    thumb = np.asarray(Image.open(site / f"img/0/{rec['images'][k][0]}.jpg").convert("RGB"), np.float32)
    cell = 28  # 84 pixels / 3 patches
    inner = (slice(8, 20), slice(8, 20))  # inside a patch, clear of the outline

    def patch(img, r, c, dx=0, dy=0):
        return img[dy + r * cell : dy + (r + 1) * cell, dx + c * cell : dx + (c + 1) * cell][inner]

    hot = 0.15 * patch(thumb, 1, 2) + 0.85 * np.array([255, 110, 0], np.float32)
    assert np.abs(patch(page, 1, 2, x, y) - hot).mean() < 4
    assert np.abs(patch(page, 0, 0, x, y) - patch(thumb, 0, 0)).mean() < 6  # |value| ~0.1 of 9: nearly clear
    outline = page[y + cell + 10, x + 2 * cell + 1]  # the left edge of patch (1, 2)
    assert outline[1] > 200 and outline[0] < 80 and outline[2] < 80


class _Bar:
    """A stand-in for actstore.progress.bar that records each bar and its updates."""

    made: list[_Bar] = []

    def __init__(self, **kw):
        self.desc, self.total, self.done = kw["desc"], kw["total"], 0
        _Bar.made.append(self)

    def update(self, n=1):
        self.done += n


def test_every_long_step_of_view_and_features_shows_progress(vit, tmp_path, monkeypatch):
    """A bar on each step that grows with the data, for images and for text, each ending at
    its total."""
    from factory import word_store, word_tokenizer

    import actstore.progress

    monkeypatch.setattr(actstore.progress, "bar", _Bar)
    store, feat, _ = vit
    _Bar.made = []
    build_site(str(feat), tmp_path / "site", progress=True)
    assert [(b.desc, b.total, b.done) for b in _Bar.made] == [
        ("patches", 5, 5),  # the distinct examples of the rows, each read once
        ("images", 5, 5),  # the distinct images, each written once
        ("features", D, D),
        ("plots", 5, 5),
    ]
    text = word_store(tmp_path / "txt", word_tokenizer(tmp_path / "tok"), d_model=D)
    _Bar.made = []
    run_features(text, 4, str(tmp_path / "tfeat"), neurons=True, top_k=2, progress=True)
    assert [(b.desc, b.total, b.done) for b in _Bar.made] == [("features", 12, 12)]  # the pass, by example
    _Bar.made = []
    build_site(str(tmp_path / "tfeat"), tmp_path / "tsite", progress=True)
    assert [b.desc for b in _Bar.made] == ["examples", "windows decoded", "features", "plots"]
    assert all(b.done == b.total > 0 for b in _Bar.made)
    sae, _, _ = _sae(tmp_path / "sae", 8)  # with a decoder: its cosine neighbours too
    run_features(store, 11, str(tmp_path / "sfeat"), sae=str(sae), top_k=2)
    _Bar.made = []
    build_site(str(tmp_path / "sfeat"), tmp_path / "ssite", progress=True)
    assert [(b.desc, b.total, b.done) for b in _Bar.made][2:] == [
        ("neighbours", 8, 8),
        ("features", 8, 8),
        ("plots", 5, 5),
    ]


def test_the_page_decodes_every_float16_exactly(tmp_path):
    """The pages' decoder of packed float16 (common.js) gives each of the 65,536 bit
    patterns the value numpy gives it (NaNs as NaN), in chromium."""
    import shutil

    from actstore.features.views import sitedata
    from actstore.features.views.site import STATIC

    exe = _chromium()
    bits = np.arange(1 << 16, dtype=np.uint16)
    half = bits.view(np.float16)
    shutil.copyfile(STATIC / "common.js", tmp_path / "common.js")
    (tmp_path / "data.js").write_text(
        "var H = "
        + json.dumps(sitedata.pack(half, "<f2"))
        + ", F = "
        + json.dumps(sitedata.pack(half.astype(np.float32), "<f4"))
        + ";\n"
    )
    (tmp_path / "t.html").write_text(
        '<!doctype html><body><p id="out"></p><script src="common.js"></script><script src="data.js"></script><script>'
        "var h = ACTSTORE.unpack(H), f = ACTSTORE.unpack(F), bad = 0;"
        "for (var i = 0; i < h.length; i++) { if (!(h[i] === f[i] || (h[i] !== h[i] && f[i] !== f[i]))) { bad++; } }"
        'document.getElementById("out").textContent = "decoded " + h.length + " bad " + bad;'
        "</script></body>"
    )
    dom = _browser(exe, tmp_path / "prof", "--dump-dom", url=(tmp_path / "t.html").as_uri())
    assert "decoded 65536 bad 0" in dom


def test_embedded_sklearn_images_load_as_sklearn_loads_them(tmp_path):
    """sklearn:china and sklearn:flower are the pixels of sklearn's load_sample_images, read
    without importing sklearn.datasets (it imports scipy: seconds of a view's thumbnails)."""
    import subprocess
    import sys

    from sklearn.datasets import load_sample_images

    code = (
        "import sys, numpy as np; from actstore.inputs.embedded import load_embedded_image as L; "
        "a = [L('sklearn:china'), L('sklearn:flower')]; np.save(sys.argv[1], np.stack(a)); "
        "print('sklearn.datasets' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a.npy")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.stack(load_sample_images().images))
