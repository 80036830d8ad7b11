"""Sparse mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, whose
gated MLPs run in a backend (`minisgl.moe`, passed in), weighted by the router and summed per
token."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import TensorParallel
from minisgl.kernel.cpu import CpuKernels

from .activation import silu_and_mul
from .linear import CpuProjection, Linear, c_matmuls_take, onednn_packs
from .quant_weight import QuantizedWeight
from .quantized import QuantizedProjection, int8_group, quantize

# The two projections of every expert of a layer, by name: gate and up [E, 2I, H], down [E, H, I].
EXPERT_STACKS = ("w_gate_up", "w_down")


class ExpertStack:
    """One projection of every expert of a layer: the stacked dense weight [E, N, K], or a
    projection per expert holding its only copy of the weights: quantized, or packed for the C
    matmuls (`packs_dense_experts`)."""

    def __init__(
        self,
        dense: torch.Tensor | None,
        projections: list[QuantizedProjection] | list[CpuProjection] | None = None,
    ) -> None:
        self.dense, self.projections = dense, projections

    def __call__(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] @ expert's weight^T: [T, N]."""
        if self.projections is not None:
            return self.projections[expert](rows, _NOT_READ, None)
        assert self.dense is not None
        return F.linear(rows, self.dense[expert])

    def silu_and_mul(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate_up stack's expert: [T, N / 2], SiLU in the matmul where the
        expert's projection fuses it."""
        if self.projections is not None:
            fused = self.projections[expert].silu_and_mul(rows)
            if fused is not None:
                return fused
        return silu_and_mul(self(expert, rows))

    @property
    def nbytes(self) -> int:
        """Bytes of the weights it holds (quantized ones as stored, packed copies as packed)."""
        if self.projections is None:
            assert self.dense is not None
            return self.dense.numel() * self.dense.element_size()
        return sum(p.nbytes for p in self.projections)


def packs_dense_experts(dtype: torch.dtype, kernels: CpuKernels | None) -> bool:
    """Whether dense experts of this dtype are packed per expert (a CpuProjection each, as a
    dense Linear's weight): wherever the C matmuls or oneDNN pack the dtype. F.linear on the
    stack ran PyTorch's reference loop on bf16 where oneDNN packs none (AVX2: a 512-token
    prefill of a small MoE 4x slower than its int8 copy), and elsewhere summed a row another way
    at one row than at several (oneDNN's bf16 at k >= 2,048; MKL's float32 at 1, 2, 3, 5, 9
    rows), so a token's output depended on how many tokens shared its expert."""
    return c_matmuls_take(dtype, kernels) or onednn_packs(dtype)


# A quantized projection's weight argument, which it does not read.
_NOT_READ = torch.empty(0)

# (x [T, H], gate_up, down, expert ids [T, K], weights [T, K]) -> [T, H]
ExpertsBackend = Callable[
    [torch.Tensor, ExpertStack, ExpertStack, torch.Tensor, torch.Tensor], torch.Tensor
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
    stacked per layer (the loader fills them from the checkpoint's per-expert projections), or,
    quantized (at load by `quantization`, or as a quantized checkpoint holds them), a quantized
    projection per expert in their place (`prepare_for_cpu`)."""

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
        self.num_experts = num_experts
        # Tensor parallelism: each expert holds this rank's intermediate rows (its router all
        # of them, so every rank routes alike); the partial outputs are summed once.
        self.reduce = reduce if reduce is not None and reduce.sharded else None
        self.gate = Linear(hidden_size, num_experts)
        shape_gate_up = (num_experts, 2 * intermediate_size, hidden_size)
        shape_down = (num_experts, hidden_size, intermediate_size)
        self.w_gate_up = nn.Parameter(torch.empty(shape_gate_up), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(shape_down), requires_grad=False)
        # Set before loading: quantize the experts by this method (quantized.LOAD_QUANTIZATIONS).
        self.quantization: str | None = None
        # EXPERT_STACKS name -> its stack of a projection per expert (quantized or packed)
        self.expert_stacks: dict[str, ExpertStack] = {}

    def prepare_for_cpu(
        self, stack: str, weight: torch.Tensor | QuantizedWeight, kernels: CpuKernels | None
    ) -> None:
        """Take the loader's hand-over of an expert stack (EXPERT_STACKS): a checkpoint's
        quantized rows (every expert's, stacked), or the dense [E, N, K] (a temporary), which is
        quantized per expert by `quantization`, packed per expert where `packs_dense_experts`,
        or kept dense (no quantization asked, or no group fits it)."""
        if stack not in EXPERT_STACKS:
            raise ValueError(f"SparseMoE: no expert stack {stack!r} (one of {EXPERT_STACKS})")
        if isinstance(weight, QuantizedWeight):
            rows = weight.out_features // self.num_experts
            experts = [
                weight.rows(torch.arange(e * rows, (e + 1) * rows)) for e in range(self.num_experts)
            ]
        else:
            method = self.quantization
            if method is None:
                quantized = []
            else:
                group_int8 = int8_group(method, kernels, weight.shape[-1])
                quantized = [quantize(w, method, group_int8) for w in weight]
            if not quantized or any(q is None for q in quantized):
                self._keep_dense(stack, weight, kernels)
                return
            experts = [q for q in quantized if q is not None]
        gated = stack == "w_gate_up"
        int8_x, weight_only = self.quantization == "int8", self.quantization == "int8-wo"
        projections = [
            QuantizedProjection(
                q, kernels, gated=gated, int8_activations=int8_x, weight_only=weight_only
            )
            for q in experts
        ]
        self.expert_stacks[stack] = ExpertStack(None, projections)
        setattr(self, stack, nn.Parameter(torch.empty(0), requires_grad=False))

    def _keep_dense(self, stack: str, weight: torch.Tensor, kernels: CpuKernels | None) -> None:
        """A dense stack: packed per expert where `packs_dense_experts`, else kept as it is."""
        if not packs_dense_experts(weight.dtype, kernels):
            setattr(self, stack, nn.Parameter(weight.clone(), requires_grad=False))
            return
        gated = stack == "w_gate_up"
        projections = [CpuProjection(w.contiguous(), kernels, gated=gated) for w in weight]
        self.expert_stacks[stack] = ExpertStack(None, projections)
        setattr(self, stack, nn.Parameter(torch.empty(0), requires_grad=False))

    def stacks(self) -> tuple[ExpertStack, ExpertStack]:
        """(gate_up, down) as the backend multiplies them."""
        gate_up = self.expert_stacks.get("w_gate_up") or ExpertStack(self.w_gate_up)
        down = self.expert_stacks.get("w_down") or ExpertStack(self.w_down)
        return gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.backend(x, *self.stacks(), ids, weights)
        return out if self.reduce is None else self.reduce.all_reduce(out)
