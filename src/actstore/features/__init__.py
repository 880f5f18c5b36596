"""Feature views: encoders per direction source, the streaming top-k pass, its tables,
context around each example, and a static site (docs/features.md)."""

from __future__ import annotations

from actstore.errors import EncoderError, FeatureError, TokenizerNotFoundError
from actstore.features.encoders.encoder import Encoder, neurons
from actstore.features.encoders.sources import load_dictionary_learning, load_directions, load_saelens, load_saev
from actstore.features.topk.layerpass import FeatureTables, top_activations

__all__ = [
    "Encoder",
    "EncoderError",
    "FeatureError",
    "FeatureTables",
    "TokenizerNotFoundError",
    "load_dictionary_learning",
    "load_directions",
    "load_saelens",
    "load_saev",
    "neurons",
    "top_activations",
]
