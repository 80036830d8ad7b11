"""Sparse mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, whose
gated MLPs run in a backend (`minisgl.moe`, passed in), weighted by the router and summed per
token."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.core import TensorParallel

from .linear import Linear

# (x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], expert ids [T, K], weights [T, K]) -> [T, H]
ExpertsBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in the logits' dtype, expert ids [T, K]) from router logits [T, E], as
    transformers' Qwen3MoeTopKRouter: float32 softmax, top-k, optional renormalisation, cast."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    """The router `gate` [E, H] and every expert's gate/up [E, 2I, H] and down [E, H, I] weights
    stacked per layer (the loader fills them from the checkpoint's per-expert projections)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        backend: ExpertsBackend,
        reduce: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.backend = top_k, norm_topk_prob, backend
        # Tensor parallelism: each expert holds this rank's intermediate rows (its router all
        # of them, so every rank routes alike); the partial outputs are summed once.
        self.reduce = reduce if reduce is not None and reduce.sharded else None
        self.gate = Linear(hidden_size, num_experts)
        shape_gate_up = (num_experts, 2 * intermediate_size, hidden_size)
        shape_down = (num_experts, hidden_size, intermediate_size)
        self.w_gate_up = nn.Parameter(torch.empty(shape_gate_up), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(shape_down), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.backend(x, self.w_gate_up, self.w_down, ids, weights)
        return out if self.reduce is None else self.reduce.all_reduce(out)
