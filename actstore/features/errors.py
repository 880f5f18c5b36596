"""The errors of feature views: each names what is wrong and how to fix it."""

from __future__ import annotations

from actstore.errors import ActstoreError


class FeatureError(ActstoreError, ValueError):
    """A feature pass was asked for something the store or the options cannot give."""


class EncoderError(FeatureError):
    """A direction source (SAE checkpoint, directions matrix) is unreadable or does not fit."""


class TokenizerNotFoundError(FeatureError, FileNotFoundError):
    """The store records no tokenizer that can be loaded from files (pass --tokenizer)."""
