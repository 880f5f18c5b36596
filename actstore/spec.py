"""Transitional alias of actstore.layout.spec (removed once every module imports it from there)."""

from actstore.layout.spec import *  # noqa: F401,F403
from actstore.layout.spec import token_dim  # noqa: F401
