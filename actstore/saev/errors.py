"""Errors of the saev exporter and reader (part of actstore's exception tree)."""

from __future__ import annotations

from actstore.errors import ActstoreError, CorruptStoreError


class SaevOptionError(ActstoreError, ValueError):
    """An export option (or the store's metadata it defaults to) does not fit the protocol."""


class SaevExistsError(ActstoreError, FileExistsError):
    """The target <HASH> directory exists but does not verify; pass overwrite=True to rebuild it."""


class SaevExportError(ActstoreError, RuntimeError):
    """An export's directory did not pass verify-saev before publication (nothing was published)."""


class SaevFormatError(CorruptStoreError):
    """A saev shard directory breaks a rule of its protocol."""
