"""QuantEmbedding: nn.Embedding's drop-in holding the table in a quantized format's canonical layout
(formats.py). A lookup dequantizes only the rows it reads, so no dense copy of the table ever exists;
every stored tensor of every format is per output row, which is what makes a row gather exact."""
from __future__ import annotations

import torch
from torch import nn

from .formats import Format


class QuantEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: Format):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        for name, (dtype, shape) in fmt.stored_shapes(num_embeddings, embedding_dim).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.fmt.stored_shapes(1, self.embedding_dim)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 (*ids.shape, embedding_dim)."""
        flat = ids.reshape(-1)  # an id out of range raises IndexError, as in nn.Embedding
        rows = {name: t.index_select(0, flat) for name, t in self.stored().items()}  # each (n, ...)
        return self.fmt.dequantize(rows, self.embedding_dim).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt.name}"
