"""The images of a vision site (`actstore view` of a ViT store), each written once: the image
the model saw (its recorded reference, resized and centre-cropped as the capture did) as a
JPEG thumbnail of `size` pixels, `img/<n // 1000>/<n>.jpg`. Examples whose references are
equal share one file. The page draws each feature's per-patch activations over them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FeatureError
from actstore.progress import updater
from actstore.read.api import Reader

DEFAULT_SIZE = 224  # thumbnail pixels (the common ViT input size: drawn 1:1)
MIN_SIZE, MAX_SIZE = 16, 1024
QUALITY = 90  # JPEG quality of the thumbnails (colour kept at full resolution: 4:4:4)
BUCKET = 1000  # thumbnails per img/ folder
THREADS = 4  # decoding, resizing and encoding release the GIL


@dataclass(frozen=True)
class Thumbnails:
    """Where each example's image went.

    Attributes:
        examples: (m,) the distinct examples, sorted.
        file: (m,) each one's thumbnail number (`thumb_path`).
        name: each one's name: its sample key, else its file name or embedded name.
        n_files: thumbnails written (distinct references).
    """

    examples: np.ndarray
    file: np.ndarray
    name: list[str]
    n_files: int

    def of(self, examples: np.ndarray) -> np.ndarray:
        """Positions of `examples` in `self.examples` (each must be there)."""
        return np.searchsorted(self.examples, examples)


def thumb_path(n: int) -> str:
    """The site-relative path of thumbnail n (feature-page.js builds the same)."""
    return f"img/{n // BUCKET}/{n}.jpg"


def parse_size(size: int) -> int:
    """A thumbnail size in pixels, checked."""
    if not isinstance(size, int) or isinstance(size, bool) or not MIN_SIZE <= size <= MAX_SIZE:
        raise FeatureError(f"--thumb-size must be an int in [{MIN_SIZE}, {MAX_SIZE}] pixels. Got {size!r}.")
    return size


def image_name(key: Any, ref: dict[str, Any]) -> str:
    """What a page calls an image: its sample key, else its file's name, its embedded name or
    its datasets row."""
    if key not in ("", None):
        return str(key)
    if "path" in ref:
        return os.path.basename(str(ref["path"]))
    if "embedded" in ref:
        return str(ref["embedded"])
    if "dataset" in ref:
        return f"{os.path.basename(str(ref['dataset']))}[{ref.get('row')}]"
    return json.dumps(ref, sort_keys=True)


def write_thumbnails(
    store: Reader, examples: np.ndarray, folder: Path, *, size: int = DEFAULT_SIZE, progress: Any = None
) -> Thumbnails:
    """Write the thumbnail of every distinct image among `examples` under `folder` (the site).

    Args:
        size: the thumbnail's side in pixels.
        progress: True for a bar on stderr, or a callable taking the images written.
    """
    from concurrent.futures import ThreadPoolExecutor

    from actstore.features.views.context import image_ref

    size = parse_size(size)
    exs = np.unique(np.asarray(examples, np.int64))
    model_size = int(store.config.attrs["image"]["size"])
    files: dict[str, int] = {}
    todo: list[tuple[int, dict[str, Any]]] = []
    file = np.zeros(len(exs), np.int64)
    names = []
    for i, ex in enumerate(exs.tolist()):
        sample, ref = image_ref(store, ex)
        text = json.dumps(ref, sort_keys=True)
        n = files.get(text)
        if n is None:
            n = files[text] = len(files)
            todo.append((n, ref))
        file[i] = n
        names.append(image_name(sample.get("sample_key"), ref))
    for b in sorted({n // BUCKET for n, _ in todo}):
        (folder / "img" / str(b)).mkdir(parents=True, exist_ok=True)
    bar = updater(progress, len(todo), "images", "image")
    with ThreadPoolExecutor(THREADS, thread_name_prefix="thumbs") as pool:
        for _ in pool.map(lambda job: _write(folder / thumb_path(job[0]), job[1], model_size, size), todo):
            if bar is not None:
                bar(1)
    return Thumbnails(examples=exs, file=file, name=names, n_files=len(files))


def _write(path: Path, ref: dict[str, Any], model_size: int, size: int) -> None:
    """One thumbnail: the image as the model saw it, at `size` pixels."""
    from PIL import Image

    from actstore.features.views.context import ref_pixels

    img = Image.fromarray(ref_pixels(ref, model_size))
    if size != model_size:
        img = img.resize((size, size), Image.BICUBIC)
    img.save(path, format="JPEG", quality=QUALITY, subsampling=0)  # inside the site's staging folder: published whole
