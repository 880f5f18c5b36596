"""Readers of direction sources, each to an Encoder (actstore.features.encoders.encoder).

- SAELens (sae-lens 6.x): a folder with `cfg.json` and `sae_weights.safetensors`;
  architectures standard, jumprelu, topk; `apply_b_dec_to_input` and `normalize_activations`
  (constant_norm_rescale, layer_norm; none and expected_average_only_in encode unchanged, as
  SAELens's own encode does) as cfg.json says.
- saev (OSU-NLP-Group/saev, src/saev/nn/modeling.py at 3d73f1f): one file, a JSON header
  line then a torch state dict (W_enc (d_model, d_sae), b_enc, W_dec, b_dec, and
  `activation.threshold` for BatchTopK); encode is `act(x @ W_enc + b_enc)` (no b_dec
  subtraction); activations Relu, TopK (top_k; the kept values stay signed), BatchTopK
  (eval: JumpReLU at its threshold, ReLU when the threshold is <= 0).
- dictionary_learning (saprmarks/dictionary_learning at 60ec6bf): a folder with `ae.pt` (a
  torch state dict) and `config.json` (`trainer.dict_class`): AutoEncoder
  (`relu(encoder(x - bias))`), JumpReluAutoEncoder, AutoEncoderTopK, BatchTopKSAE.
- a plain directions matrix: `.npy` (d_model, F), or safetensors holding one 2-D tensor (or
  `W` / `directions`, with an optional `b` / `bias`); a separate bias `.npy` may be given.

torch is imported only for the two formats stored with torch.save, always with
`weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import EncoderError, FeatureError
from actstore.features.encoders.encoder import Encoder

SAELENS_ARCHITECTURES = ("standard", "jumprelu", "topk")
SAELENS_NORMALIZE = {
    "none": "none",
    "expected_average_only_in": "none",
    "constant_norm_rescale": "constant_norm_rescale",
    "layer_norm": "layer_norm",
}
DL_CLASSES = ("AutoEncoder", "JumpReluAutoEncoder", "AutoEncoderTopK", "BatchTopKSAE")
MAX_HEADER_BYTES = 1 << 20  # a saev checkpoint's JSON header line


def sha256_of(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _f32(a: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(a.float().numpy() if hasattr(a, "float") else a, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise EncoderError(f"{what} is not a float array: {e}") from None
    if not np.isfinite(arr).all():
        raise EncoderError(f"{what} holds NaN or infinite values: the checkpoint is damaged")
    return np.ascontiguousarray(arr)


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if not path.is_file():
        raise EncoderError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError (and others) on bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "bf16" in first.lower() or "bfloat16" in first.lower():  # numpy has no bfloat16: read it with torch
            try:
                from safetensors.torch import load_file as load_torch

                return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}
            except ImportError:
                raise EncoderError(
                    f"{path} holds bfloat16 tensors: reading them needs torch (pip install 'actstore[torch]')"
                ) from None
        raise EncoderError(
            f"{path} is not a readable safetensors file ({first}); re-save it with safetensors"
        ) from None


def _need(d: dict[str, Any], names: tuple[str, ...], where: Path) -> None:
    missing = [n for n in names if n not in d]
    if missing:
        raise EncoderError(f"{where} lacks tensors {missing}; it holds {sorted(d)}")


def load_saelens(folder: str | Path) -> Encoder:
    """An SAELens checkpoint folder (`cfg.json` + `sae_weights.safetensors`)."""
    folder = Path(folder)
    cfg_path, w_path = folder / "cfg.json", folder / "sae_weights.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise EncoderError(
            f"{folder} is not an SAELens checkpoint: it needs cfg.json and sae_weights.safetensors "
            f"(found {sorted(p.name for p in folder.iterdir()) if folder.is_dir() else 'no folder'})"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise EncoderError(f"{cfg_path} is not JSON: {e}") from None
    arch = cfg.get("architecture", "standard")
    if arch not in SAELENS_ARCHITECTURES:
        raise EncoderError(
            f"SAELens architecture must be one of {list(SAELENS_ARCHITECTURES)}. Got {arch!r} in {cfg_path}."
        )
    norm = cfg.get("normalize_activations", "none")
    if norm not in SAELENS_NORMALIZE:
        raise EncoderError(
            f"normalize_activations must be one of {list(SAELENS_NORMALIZE)} to encode here. Got {norm!r} in {cfg_path}."
        )
    w = _safetensors(w_path)
    _need(w, ("W_enc", "b_enc", "W_dec", "b_dec"), w_path)
    W = _f32(w["W_enc"], "W_enc")
    d_in, F = W.shape
    if "d_in" in cfg and (cfg["d_in"], cfg.get("d_sae", F)) != (d_in, F):
        raise EncoderError(f"{cfg_path} says d_in={cfg['d_in']}, d_sae={cfg.get('d_sae')} but W_enc is {W.shape}")
    W_dec = _f32(w["W_dec"], "W_dec")
    kw: dict[str, Any] = {"activation": "relu"}
    if arch == "jumprelu":
        if "threshold" in w:
            thr = _f32(w["threshold"], "threshold")
        elif "log_threshold" in w:
            thr = np.exp(_f32(w["log_threshold"], "log_threshold"))
        else:
            raise EncoderError(
                f"{w_path}: a jumprelu SAE needs a threshold (or log_threshold) tensor; it holds {sorted(w)}"
            )
        kw = {"activation": "jumprelu", "threshold": thr}
    elif arch == "topk":
        kw = {"activation": "topk", "k": int(cfg.get("k", 0))}
        if cfg.get("rescale_acts_by_decoder_norm"):
            kw["post_scale"] = np.linalg.norm(W_dec, axis=1).astype(np.float32)
    return Encoder(
        kind="saelens",
        d_in=d_in,
        n_features=F,
        W=W,
        b=_f32(w["b_enc"], "b_enc"),
        b_pre=_f32(w["b_dec"], "b_dec") if cfg.get("apply_b_dec_to_input", True) else None,
        normalize=SAELENS_NORMALIZE[norm],
        W_dec=W_dec,
        b_dec=_f32(w["b_dec"], "b_dec"),
        source={"path": str(folder.resolve()), "sha256": sha256_of(cfg_path, w_path), "architecture": arch},
        **kw,
    )


def _torch_state(path: Path, payload: bytes | None = None) -> dict[str, Any]:
    import io

    import torch

    if torch.__version__ < "2.6":  # TorchVersion compares as a version
        raise EncoderError(
            f"torch {torch.__version__} is older than 2.6, whose weights-only loader can be made to run code "
            f"(CVE-2025-32434); {path} is not loaded with it: upgrade torch (pip install 'torch>=2.6')"
        )
    try:
        src = io.BytesIO(payload) if payload is not None else str(path)
        state = torch.load(src, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises pickle, zip and runtime errors on bad files
        raise EncoderError(f"{path} holds no readable torch state dict ({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise EncoderError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def load_saev(path: str | Path) -> Encoder:
    """A saev checkpoint file (JSON header line, then a torch state dict)."""
    path = Path(path)
    if not path.is_file():
        raise EncoderError(f"{path} is not a saev checkpoint file (it does not exist)")
    with open(path, "rb") as f:
        line = f.readline(MAX_HEADER_BYTES)
        rest = f.read()
    try:
        header = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise EncoderError(f"{path} does not start with saev's JSON header line: not a saev checkpoint") from None
    cfg = header.get("cfg", header) if isinstance(header, dict) else {}
    act = cfg.get("activation", {"cls": "Relu"}) if "schema" in header else {"cls": "Relu"}
    name = act.get("cls", "Relu") if isinstance(act, dict) else "Relu"
    params = act.get("params", {}) if isinstance(act, dict) else {}
    state = _torch_state(path, rest)
    _need(state, ("W_enc", "b_enc", "W_dec", "b_dec"), path)
    W = _f32(state["W_enc"], "W_enc")
    kw: dict[str, Any]
    if name == "Relu":
        kw = {"activation": "relu"}
    elif name == "TopK":
        kw = {"activation": "topk", "k": int(params.get("top_k", 32)), "topk_relu": False}
    elif name == "BatchTopK":
        thr = float(state.get("activation.threshold", np.float32(0.0)))
        kw = {"activation": "jumprelu", "threshold": np.float32(max(thr, 0.0))}
    else:
        raise EncoderError(f"saev activation must be Relu, TopK or BatchTopK. Got {name!r} in {path}.")
    return Encoder(
        kind="saev",
        d_in=W.shape[0],
        n_features=W.shape[1],
        W=W,
        b=_f32(state["b_enc"], "b_enc"),
        W_dec=_f32(state["W_dec"], "W_dec"),
        source={"path": str(path.resolve()), "sha256": sha256_of(path), "architecture": name},
        **kw,
    )


def load_dictionary_learning(path: str | Path) -> Encoder:
    """A dictionary_learning trainer folder (`ae.pt` + `config.json`), or its `ae.pt`."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    ae, cfg_path = (folder / "ae.pt", folder / "config.json") if path.is_dir() else (path, folder / "config.json")
    if not ae.is_file() or not cfg_path.is_file():
        raise EncoderError(
            f"{path} is not a dictionary_learning checkpoint: it needs ae.pt and config.json in {folder}"
        )
    try:
        dict_class = json.loads(cfg_path.read_text())["trainer"]["dict_class"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise EncoderError(f"{cfg_path} lacks trainer.dict_class (dictionary_learning writes it)") from None
    if dict_class not in DL_CLASSES:
        raise EncoderError(
            f"dictionary_learning dict_class must be one of {list(DL_CLASSES)}. Got {dict_class!r} in {cfg_path}."
        )
    s = _torch_state(ae)
    src = {"path": str(folder.resolve()), "sha256": sha256_of(cfg_path, ae), "architecture": dict_class}
    if dict_class == "JumpReluAutoEncoder":
        _need(s, ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"), ae)
        W = _f32(s["W_enc"], "W_enc")
        return Encoder(
            kind="dictionary_learning",
            d_in=W.shape[0],
            n_features=W.shape[1],
            W=W,
            b=_f32(s["b_enc"], "b_enc"),
            activation="jumprelu",
            threshold=_f32(s["threshold"], "threshold"),
            W_dec=_f32(s["W_dec"], "W_dec"),
            source=src,
        )
    bias = "bias" if dict_class == "AutoEncoder" else "b_dec"
    _need(s, ("encoder.weight", "encoder.bias", "decoder.weight", bias), ae)
    W = _f32(s["encoder.weight"], "encoder.weight").T.copy()  # nn.Linear keeps (F, d_in)
    kw: dict[str, Any] = {"activation": "relu"}
    if dict_class == "AutoEncoderTopK":
        kw = {"activation": "topk", "k": int(s["k"]) if "k" in s else 0}
    elif dict_class == "BatchTopKSAE":  # encode's default use_threshold=True
        kw = {"activation": "jumprelu", "threshold": np.float32(float(s.get("threshold", -1.0)))}
    return Encoder(
        kind="dictionary_learning",
        d_in=W.shape[0],
        n_features=W.shape[1],
        W=W,
        b=_f32(s["encoder.bias"], "encoder.bias"),
        b_pre=_f32(s[bias], bias),
        W_dec=_f32(s["decoder.weight"], "decoder.weight").T.copy(),
        source=src,
        **kw,
    )


def load_directions(path: str | Path, bias: str | Path | None = None) -> Encoder:
    """A (d_model, F) matrix of directions (`.npy` or safetensors), optional (F,) bias:
    feature values are `x @ W + b`, signed (probes)."""
    path = Path(path)
    b = None
    if path.suffix == ".npy":
        try:
            W = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise EncoderError(f"{path} is not a readable .npy file: {e}") from None
    elif path.suffix == ".safetensors":
        t = _safetensors(path)
        key = next((k for k in ("W", "directions") if k in t), None)
        mats = [k for k, v in t.items() if v.ndim == 2]
        if key is None and len(mats) != 1:
            raise EncoderError(f"{path}: name the directions tensor 'W' or 'directions' (it holds {sorted(t)})")
        W = t[key or mats[0]]
        b = next((t[k] for k in ("b", "bias") if k in t), None)
    else:
        raise EncoderError(f"directions must be a .npy or .safetensors file, got {path.name!r}")
    W = _f32(W, f"the directions in {path}")
    if W.ndim != 2:
        raise EncoderError(f"{path} holds an array of shape {W.shape}: directions must be a (d_model, F) matrix")
    bias_from = path if bias is None else Path(bias)
    if bias is not None:
        try:
            b = np.load(bias_from, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise EncoderError(f"--bias {bias_from} is not a readable .npy file of (F,) values: {e}") from None
    if b is not None:
        b = _f32(b, f"the bias in {bias_from}").reshape(-1)
        if b.shape != (W.shape[1],):
            raise EncoderError(
                f"the bias in {bias_from} has {b.size} values but the directions matrix {W.shape} of {path} "
                f"has F={W.shape[1]} columns: give a bias of {W.shape[1]} values"
            )
    files = [path] + ([Path(bias)] if bias is not None else [])
    return Encoder(
        kind="directions",
        d_in=W.shape[0],
        n_features=W.shape[1],
        W=W,
        b=b,
        W_dec=W.T.copy(),
        source={"path": str(path.resolve()), "sha256": sha256_of(*files)},
    )


def load(
    *,
    neurons_d_model: int | None = None,
    sae: str | Path | None = None,
    saev: str | Path | None = None,
    dictionary: str | Path | None = None,
    directions: str | Path | None = None,
    bias: str | Path | None = None,
) -> Encoder:
    """The one encoder that exactly one of the keyword arguments names."""
    from actstore.features.encoders.encoder import neurons

    given = [
        k
        for k, v in (
            ("neurons", neurons_d_model),
            ("sae", sae),
            ("saev", saev),
            ("dictionary", dictionary),
            ("directions", directions),
        )
        if v is not None
    ]
    if len(given) != 1:
        raise EncoderError(
            f"name exactly one direction source (--neurons, --sae, --saev, --dictionary or --directions); got {given or 'none'}"
        )
    if neurons_d_model is not None:
        return neurons(neurons_d_model)
    if sae is not None:
        return load_saelens(sae)
    if saev is not None:
        return load_saev(saev)
    if dictionary is not None:
        return load_dictionary_learning(dictionary)
    return load_directions(directions, bias)  # type: ignore[arg-type]


ENCODER_KINDS = ("neurons", "saelens", "saev", "dictionary_learning", "directions")


def from_meta(described: Any, d_model: int) -> Encoder:
    """The encoder that meta.json's `encoder` entry describes, read again from its path
    (the caller compares its sha256 with the recorded one)."""
    kind = described.get("kind") if isinstance(described, dict) else None
    if kind not in ENCODER_KINDS:
        raise FeatureError(
            f"meta.json's encoder.kind must be one of {list(ENCODER_KINDS)}. Got {kind!r}: the folder was not "
            "written by this version of `actstore features` (or was edited); rerun the pass"
        )
    if kind == "neurons":
        from actstore.features.encoders.encoder import neurons

        return neurons(d_model)
    path = described.get("path")
    if not isinstance(path, str) or not path:
        raise FeatureError(f"meta.json's encoder (kind {kind!r}) names no path to read it from; rerun the pass")
    if kind == "saelens":
        return load_saelens(path)
    if kind == "saev":
        return load_saev(path)
    if kind == "dictionary_learning":
        return load_dictionary_learning(path)
    return load_directions(path, described.get("bias"))
