"""Importers: activation caches of other tools -> actstore stores (docs/import.md).

- import_activault: one hook of an Activault run (metadata.json + .saved.pt megabatches).
- import_saelens: a SAELens cached-activations dataset (datasets save_to_disk folder).
- import_dictionary_learning: one submodule of a dictionary_learning activation cache.

Each runs the shared driver (actstore/importers/driver.py): one writer shard per source
file, written in parallel, resumable after a kill, finalized and verified at the end.
"""

from __future__ import annotations

import os
from typing import Any

from actstore.importers.activault import ActivaultFormatError, ActivaultSource
from actstore.importers.dictionary_learning import DictionaryLearningCacheError, DictionaryLearningSource
from actstore.importers.driver import ImportReport, ImportSourceError, ImportVerifyError, run_import
from actstore.importers.saelens import SaelensDatasetError, SaelensSource


def import_activault(
    src: Any, store: str | os.PathLike, *, hook: str | None = None, layer: int | None = None, **kwargs: Any
) -> ImportReport:
    """Import one hook of an Activault run (local folder or `s3://` URL) into `store`.

    Args:
        src: the hook's folder `{run}/{hook}`, or the run folder with `hook`.
        store: the new store (or the store of a killed import of the same source, which resumes).
        hook: the hook folder's name inside a run folder.
        layer: the store's layer number (default: the last number in the hook's name).
        **kwargs: run_import's options (workers, progress, commit_bytes, zarr_format).
    """
    return run_import(ActivaultSource(src, hook=hook, layer=layer), store, **kwargs)


def import_saelens(
    src: Any, store: str | os.PathLike, *, hook_name: str | None = None, layer: int | None = None, **kwargs: Any
) -> ImportReport:
    """Import a SAELens cached-activations folder (local or an object-store URL) into `store`.

    Args:
        src: the `save_to_disk` folder.
        store: the new store (or a killed import of the same source, which resumes).
        hook_name: the activation column (default: the only one); another name is refused.
        layer: the store's layer number (default: from the hook name, e.g. blocks.8.* -> 8).
        **kwargs: run_import's options (workers, progress, commit_bytes, zarr_format).
    """
    return run_import(SaelensSource(src, hook_name=hook_name, layer=layer), store, **kwargs)


def import_dictionary_learning(
    src: Any,
    store: str | os.PathLike,
    *,
    tokens_per_example: int | None = None,
    layer: int | None = None,
    **kwargs: Any,
) -> ImportReport:
    """Import one submodule folder of a dictionary_learning activation cache into `store`.

    Args:
        src: the folder `{store_dir}/{submodule_name}_{io}` (local).
        store: the new store (or a killed import of the same source, which resumes).
        tokens_per_example: tokens per example (default: the cache's context_len).
        layer: the store's layer number (default: the last number in the folder's name).
        **kwargs: run_import's options (workers, progress, commit_bytes, zarr_format).
    """
    return run_import(
        DictionaryLearningSource(src, tokens_per_example=tokens_per_example, layer=layer), store, **kwargs
    )


__all__ = [
    "ActivaultFormatError",
    "ActivaultSource",
    "DictionaryLearningCacheError",
    "DictionaryLearningSource",
    "import_dictionary_learning",
    "ImportReport",
    "ImportSourceError",
    "ImportVerifyError",
    "SaelensDatasetError",
    "SaelensSource",
    "import_activault",
    "import_saelens",
]
