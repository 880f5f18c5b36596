"""Transitional alias of actstore.read.store (removed once verify.py is ported)."""

from actstore.read.store import *  # noqa: F401,F403
from actstore.read.store import _consolidated, rows_on_disk  # noqa: F401
