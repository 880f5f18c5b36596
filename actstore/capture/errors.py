"""Errors of capture: each names what is wrong and how to fix it."""

from __future__ import annotations

from actstore.errors import ActstoreError


class CaptureError(ActstoreError, ValueError):
    """A capture run cannot go on (bad model, layer, data or options)."""


class UnknownLayerError(CaptureError):
    """A layer number or module path the model does not have."""


class NoBlocksError(CaptureError):
    """The model has no recognised transformer blocks."""


class ModelLoadError(CaptureError):
    """The model could not be loaded (missing package, no such folder, hub unreachable)."""


class DataError(CaptureError):
    """The data source is missing, malformed or empty."""


class EmptyDatasetError(DataError):
    """The data source holds no examples."""


class UnreadableImageError(DataError):
    """An image file that cannot be decoded."""
