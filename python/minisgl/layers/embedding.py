"""Token embedding and the output head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import linear_packed


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding weight when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tied: VocabEmbedding | None) -> None:
        super().__init__()
        self.tied = tied
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Use a oneDNN-packed copy of the (possibly tied) weight; see layers.linear."""
        weight = self.tied.weight if self.tied is not None else self.weight
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.data, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return linear_packed(hidden, self.packed_weight, None)
        weight = self.tied.weight if self.tied is not None else self.weight
        return F.linear(hidden, weight)
