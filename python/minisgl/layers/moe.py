"""Sparse mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, whose
gated MLPs run grouped by expert, weighted by the router and summed per token."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .activation import silu_and_mul
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


def grouped_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The experts in PyTorch: token-expert pairs sorted by expert, one gate_up and one down
    matmul per expert over its run of rows, each pair's output put back in place."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # The only host sync of the block: how many rows each expert's matmuls take.
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    rows = x[order // top_k]
    pair_weights = weights.reshape(-1)[order].unsqueeze(-1)
    pairs = x.new_empty(tokens * top_k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        act = silu_and_mul(F.linear(rows[start:end], w_gate_up[expert]))
        out = F.linear(act, w_down[expert]) * pair_weights[start:end]
        pairs.index_copy_(0, order[start:end], out)
        start = end
    # Summed over the top-k in one reduction (float32 accumulation for bf16), in top-k order,
    # as transformers' default experts implementation does.
    return pairs.view(tokens, top_k, -1).sum(dim=1)


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
        backend: ExpertsBackend = grouped_experts,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.backend = top_k, norm_topk_prob, backend
        self.gate = Linear(hidden_size, num_experts)
        shape_gate_up = (num_experts, 2 * intermediate_size, hidden_size)
        shape_down = (num_experts, hidden_size, intermediate_size)
        self.w_gate_up = nn.Parameter(torch.empty(shape_gate_up), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(shape_down), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.backend(x, self.w_gate_up, self.w_down, ids, weights)
