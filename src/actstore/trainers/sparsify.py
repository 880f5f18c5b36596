"""sparsify (EleutherAI, PyPI `eai-sparsify`) from a store, without running the model.

sparsify's `Trainer(cfg, dataset, model)` iterates `dataset` in order (a DataLoader with
`cfg.batch_size` rows of `input_ids`, no shuffle), runs `model(input_ids)` and trains on
what forward hooks on `model.base_model.layers.{i}` see. `sparsify_inputs` gives it:
- a `datasets.Dataset` whose row r holds the pointers r * S ... r * S + S - 1 (S =
  `tokens_per_row`): row r stands for batch r of an aligned TokenStream over the layers
  (one shuffle, real tokens only, every layer the same tokens);
- a ReplayModel whose forward takes the next rows of that stream and passes layer i's
  vectors through its module `layers.i`, so the Trainer's hooks see the stored activations.
Rows are served in order; a resumed Trainer (`dataset.select(range(n, ...))`) repositions
the stream exactly (its plan is a pure function of the seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from actstore.errors import ActstoreError

if TYPE_CHECKING:
    from actstore.read.api import ReaderLike


class _Layer(nn.Module):
    """Layer i's stand-in: returns the stored vectors it is handed (the hooks see them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Config:
    def __init__(self, n: int):
        self.num_hidden_layers = n


class ReplayModel(nn.Module):
    """A stand-in model whose layer modules output a store's activations (see the module docstring).

    Args:
        stream: an aligned TokenStream over the layers (drop_last, batch_size = tokens per row).
        layers: the layer numbers of the stream's sources, in order.
        device: where the vectors go.
    """

    def __init__(self, stream: Any, layers: list[int], device: str | torch.device = "cpu"):
        super().__init__()
        self.stream, self.layer_numbers = stream, list(layers)
        self.config = _Config(max(layers) + 1)
        self.layers = nn.ModuleList(_Layer() for _ in range(max(layers) + 1))
        self._device = torch.device(device)
        self.S, self.d = stream.batch_size, int(stream.streams[0].d_model)
        self._it: Any = None
        self._next_row = 0
        self.dummy_inputs = {"input_ids": torch.full((1, 1), -1, dtype=torch.long)}

    @property
    def base_model(self) -> ReplayModel:
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        if bool((input_ids < 0).all()):  # sparsify's width probe (dummy_inputs): zeros, the stream untouched
            for i in self.layer_numbers:
                self.layers[i](torch.zeros((*input_ids.shape, self.d), device=self._device))
            return None
        rows = (input_ids[:, 0] // self.S).tolist()
        want = torch.arange(self.S, device=input_ids.device)[None, :] + (input_ids[:, :1] // self.S) * self.S
        if input_ids.shape[1] != self.S or not torch.equal(input_ids, want):
            raise ActstoreError("ReplayModel takes the rows of the dataset sparsify_inputs made, whole and unchanged")
        if rows[0] != self._next_row or self._it is None:
            self._seek(rows[0])
        parts = []
        for r in rows:
            if r != self._next_row:
                raise ActstoreError(
                    f"ReplayModel serves rows in order: expected row {self._next_row}, got {r} (no shuffling DataLoader)"
                )
            parts.append(next(self._it))
            self._next_row += 1
        for k, i in enumerate(self.layer_numbers):
            x = torch.stack([p[k] for p in parts]).to(self._device)  # (rows, S, d): one copy
            self.layers[i](x)
        return None

    def _seek(self, row: int) -> None:
        """Position the stream so that its next batch is row `row` of this epoch."""
        if self._it is not None:
            self._it.close()
        # The dataset is one epoch, and the plan a pure function of the seed: exactly row `row` comes next.
        self.stream.position.start(0, row)
        self._it, self._next_row = iter(self.stream), row


def sparsify_inputs(
    store: ReaderLike,
    *,
    layers: list[int],
    tokens_per_row: int = 2048,
    seed: int = 0,
    device: str | torch.device = "cpu",
    **stream_kwargs: Any,
) -> tuple[Any, ReplayModel]:
    """(dataset, model) for `sparsify.Trainer(TrainConfig(..., layers=layers), dataset, model)`.

    Args:
        store: an ActStore, a path or a URL.
        layers: the stored layer numbers to train SAEs on (TrainConfig.layers must equal them).
        tokens_per_row: tokens per dataset row (TrainConfig.batch_size rows make one step).
        seed: the shuffle's seed.
        device: where the model puts the vectors (the SAEs' device).
        **stream_kwargs: TokenStream options (token_mask, normalize, buffer_bytes...).
    """
    import datasets

    from actstore.loaders import TokenStream
    from actstore.read.api import as_reader

    st = as_reader(store)
    stream = TokenStream.aligned(
        st,
        batch_size=tokens_per_row,
        layers=list(layers),
        seed=seed,
        drop_last=True,
        dtype=torch.float32,
        **stream_kwargs,
    )
    n = len(stream)
    if n == 0:
        raise ValueError(f"the store holds fewer than {tokens_per_row} tokens: lower tokens_per_row")
    ids = torch.arange(n * tokens_per_row, dtype=torch.int64).reshape(n, tokens_per_row)
    ds = datasets.Dataset.from_dict({"input_ids": ids.numpy()}).with_format("torch")
    return ds, ReplayModel(stream, list(layers), device)
