"""Embedded data written out as plain files, for tools that need a folder (saev links its
`dataset` root for visuals; `embedded:images` lives inside two packages, not a folder)."""

from __future__ import annotations

import os
from pathlib import Path

from actstore.inputs.embedded import embedded_images
from actstore.storage.files import atomic_write


def write_embedded_images(folder: str | os.PathLike) -> Path:
    """Write every `embedded:images` image to `folder` as `<package>-<name>.png` (kept when
    already there, each written through a temporary file and a rename); returns the
    folder's absolute path."""
    from PIL import Image

    root = Path(os.path.abspath(folder))
    root.mkdir(parents=True, exist_ok=True)
    for name, load in embedded_images():
        path = root / (name.replace(":", "-") + ".png")
        if path.exists():
            continue
        atomic_write(path, lambda tmp, load=load: Image.fromarray(load()).save(tmp, format="PNG"))
    return root
