"""Click parameter types shared by the commands."""

from __future__ import annotations

import click

from actstore.storage import is_url


class StoreLocation(click.ParamType):
    """A store: a local folder (checked like click.Path) or an object-store URL
    (s3://, gs://, az://), passed on as given."""

    name = "store"

    def __init__(self, *, exists: bool = False):
        self.exists = exists
        self._path = click.Path(exists=exists, file_okay=False)

    def convert(self, value, param, ctx):  # noqa: D102
        text = str(value)
        if is_url(text):
            return text
        return self._path.convert(text, param, ctx)


STORE = StoreLocation(exists=True)
NEW_STORE = StoreLocation(exists=False)
