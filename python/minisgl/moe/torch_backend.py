"""The experts of a MoE layer in plain PyTorch: token-expert pairs grouped by expert, one pair
of matmuls per expert that has tokens."""

from __future__ import annotations

import torch

from minisgl.layers.moe import ExpertStack


def grouped_experts(
    x: torch.Tensor,
    gate_up: ExpertStack,
    down: ExpertStack,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The experts in PyTorch: token-expert pairs sorted by expert, one gate_up and one down
    matmul per expert over its run of rows (dense or quantized, as the stacks hold them), each
    pair's output put back in place."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # The only host sync of the block: how many rows each expert's matmuls take.
    counts = torch.bincount(flat).tolist()
    rows = x[order // top_k]
    pair_weights = weights.reshape(-1)[order].unsqueeze(-1)
    pairs = x.new_empty(tokens * top_k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        act = gate_up.silu_and_mul(expert, rows[start:end])
        out = down(expert, act) * pair_weights[start:end]
        pairs.index_copy_(0, order[start:end], out)
        start = end
    # Summed over the top-k in one reduction (float32 accumulation for bf16), in top-k order,
    # as transformers' default experts implementation does.
    return pairs.view(tokens, top_k, -1).sum(dim=1)
