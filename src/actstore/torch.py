"""torch datasets over an ActStore: `from actstore.torch import PairDataset, TokenStream`.

The implementation lives in actstore.loaders (docs/loaders.md); its public names are these.
"""

from actstore.loaders import *  # noqa: F403 - the loaders' public names, listed once (actstore.loaders.__all__)
from actstore.loaders import __all__  # noqa: F401
