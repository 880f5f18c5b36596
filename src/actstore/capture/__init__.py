"""Capture: record transformer activations into a store with forward hooks.

    actstore.record(model, batches, "acts.store", layers=[6, 11])

One CaptureOptions value holds every setting, from `actstore write`'s options to the
writer's (actstore.capture.options).

Layer N is the output of transformer block N (the residual stream after it), i.e.
`output_hidden_states[N + 1]`; module paths such as "model.layers.6.mlp" record any
module's output. `actstore write` runs the whole job from the command line. Importing this
package does not import torch; its functions do.
"""

from actstore.capture.hooks import Capture, find_blocks, resolve_hooks
from actstore.capture.options import CaptureOptions
from actstore.capture.record import RecordResult, committed, record
from actstore.capture.run import write
from actstore.errors import (
    CaptureError,
    DataError,
    EmptyDatasetError,
    ModelLoadError,
    NoBlocksError,
    UnknownLayerError,
    UnreadableImageError,
)
from actstore.inputs.models import LoadedModel, load_model
from actstore.inputs.packing import token_origins
from actstore.inputs.prepare import CaptureBatch
from actstore.read.normalize import normalization

WriteOptions = CaptureOptions  # the name before CaptureOptions, kept one release

__all__ = [
    "Capture",
    "CaptureBatch",
    "CaptureOptions",
    "CaptureError",
    "DataError",
    "EmptyDatasetError",
    "LoadedModel",
    "ModelLoadError",
    "NoBlocksError",
    "RecordResult",
    "UnknownLayerError",
    "UnreadableImageError",
    "WriteOptions",
    "committed",
    "find_blocks",
    "load_model",
    "normalization",
    "record",
    "resolve_hooks",
    "token_origins",
    "write",
]
