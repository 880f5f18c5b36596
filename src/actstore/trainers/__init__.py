"""Trainer adapters: feed other tools' SAE trainers from a store, no export (docs/loaders.md).

- dictionary_learning: `DictionaryLearningSource` for `trainSAE(data=...)` in place of its
  ActivationBuffer; `paired_source` for crosscoders (two stores or layers, one seeded shuffle).
- sparsify (eai-sparsify): `sparsify_inputs` gives its Trainer a dataset and a replay model
  whose layers output the store's vectors.
- SAELens: actstore.saelens.saelens_data_provider (for its SAETrainer).
Each draws from an (aligned) TokenStream: shuffled, resumable, real tokens only.
"""

from actstore.trainers.dictionary_learning import DictionaryLearningSource, paired_source
from actstore.trainers.sparsify import ReplayModel, sparsify_inputs

__all__ = ["DictionaryLearningSource", "ReplayModel", "paired_source", "sparsify_inputs"]
