"""Token embedding and the output head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernel.cpu import CpuKernels

from .linear import CPU_PROJECTION_DTYPES, CpuProjection


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
        self.cpu_projection: CpuProjection | None = None
        self._logits_buffer: torch.Tensor | None = None

    def _weight(self) -> torch.Tensor:
        return self.tied.weight if self.tied is not None else self.weight

    def prepare_for_cpu(self, kernels: CpuKernels | None) -> None:
        """Pick the CPU matmul path (see layers.linear); a tied weight is kept for the lookup.
        Where the C packed matmul computes the head, logits come out float32."""
        weight = self._weight()
        if weight.device.type == "cpu" and weight.dtype in CPU_PROJECTION_DTYPES:
            self.cpu_projection = CpuProjection(weight.data, kernels, float_out=True)

    def forward(self, hidden: torch.Tensor, reuse_output: bool = False) -> torch.Tensor:
        """Logits [rows, vocab]. reuse_output: on the C matmul's path they are written into a
        buffer the next such call overwrites, as a CUDA graph's outputs are. glibc maps every
        block over 32 MB afresh, so e.g. Qwen3's 64 x 151,936 float32 logits page-faulted
        10 ms of a 23 ms head each decode step."""
        if self.cpu_projection is None:
            return F.linear(hidden, self._weight())
        out = None
        if reuse_output and self.cpu_projection.float_out and hidden.dim() == 2:
            rows, vocab = hidden.shape[0], self.cpu_projection.out_features
            if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, vocab, dtype=torch.float32)
            out = self._logits_buffer[:rows]
        return self.cpu_projection(hidden, self._weight(), None, out)
