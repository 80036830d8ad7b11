"""Low-rank adapter deltas of one projection for every resident adapter at once (multi-LoRA):
the batch's rows each select their adapter's slot through a mask, so rows of different
adapters (and of none) share one pair of matmuls, with no loop over requests or adapters."""

from __future__ import annotations

import torch
from torch import nn


class LoraSlots(nn.Module):
    """delta(x) = ((x A^T) * mask) B^T for a projection of `in_features` inputs whose output
    stacks `part_features` (qkv: q, k, v; gate_up: gate, up; else one part): A [parts * slots *
    rank, in_features], each part's slots side by side; B [out, parts * slots * rank], each part's
    rows reading only its own columns. A slot holds one adapter's A and B (zeros past its rank
    and for the parts it does not adapt); `mask` [rows, slots * rank] holds each row's scaling
    on its slot's columns (zeros elsewhere: a row without an adapter gets no delta)."""

    def __init__(
        self,
        in_features: int,
        part_features: list[int],
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.part_features, self.slots, self.rank = list(part_features), slots, rank
        width = len(part_features) * slots * rank
        self.lora_a = torch.zeros(width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(sum(part_features), width, dtype=dtype, device=device)

    def _columns(self, part: int, slot: int) -> slice:
        start = (part * self.slots + slot) * self.rank
        return slice(start, start + self.rank)

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter in `slot`: per part its (A [r, in], B [out_part, r]) or None."""
        if len(parts) != len(self.part_features):
            raise ValueError(f"expected {len(self.part_features)} parts, got {len(parts)}")
        self.clear(slot)
        row = 0
        for index, (features, weights) in enumerate(zip(self.part_features, parts)):
            if weights is not None:
                a, b = weights
                rank = a.shape[0]
                if rank > self.rank or tuple(b.shape) != (features, rank):
                    raise ValueError(
                        f"part {index}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                        f"rank <= {self.rank} and {features} outputs"
                    )
                cols = self._columns(index, slot)
                self.lora_a[cols.start : cols.start + rank] = a.to(self.lora_a.dtype)
                self.lora_b[row : row + features, cols.start : cols.start + rank] = b.to(
                    self.lora_b.dtype
                )
            row += features

    def clear(self, slot: int) -> None:
        for part in range(len(self.part_features)):
            cols = self._columns(part, slot)
            self.lora_a[cols] = 0
            self.lora_b[:, cols] = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The delta of x [rows, in] under `mask` [rows, slots * rank] (see the class)."""
        shrunk = x.to(self.lora_a.dtype) @ self.lora_a.T
        parts = len(self.part_features)
        scaled = shrunk * (mask if parts == 1 else mask.repeat(1, parts))
        return scaled @ self.lora_b.T
