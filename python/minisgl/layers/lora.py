"""Low-rank adapter deltas of one projection for every resident adapter at once (multi-LoRA):
the batch's rows each select their adapter's slot through a mask, so rows of different
adapters (and of none) share one pair of matmuls, with no loop over requests or adapters."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel.abi import ProjectionParams
from minisgl.kernel.cpu import CpuKernels


class LoraSlots(nn.Module):
    """delta(x) = ((x A^T) * mask) B^T for a projection of `in_features` inputs whose output
    stacks `part_features` (qkv: q, k, v; gate_up: gate, up; else one part): A [parts * slots *
    rank, in_features], each part's slots side by side; B^T [parts * slots * rank, out] (the C
    decode layer's form), each part's output columns reading only its own rows. A slot holds one adapter's A and B (zeros past its rank
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
        kernels: CpuKernels | None = None,
    ) -> None:
        """kernels: the C kernels, where bf16 rows take their deltas from them (the C decode
        layer's sums: the same bits on either path)."""
        super().__init__()
        self.part_features, self.slots, self.rank = list(part_features), slots, rank
        width = len(part_features) * slots * rank
        self.lora_a = torch.zeros(width, in_features, dtype=dtype, device=device)
        # Layers are made outside inference mode, so A and B^T can be written in place later.
        self.lora_bt = torch.zeros(width, sum(part_features), dtype=dtype, device=device)
        self.kernels = kernels if dtype == torch.float32 and device.type == "cpu" else None
        self.part_rows = torch.tensor(part_features, dtype=torch.int64)  # the C form's
        # Where smoothing (models/smoothing.py) divides the projection's input channels by
        # these, A's columns are multiplied by them as adapters load; where it divides output
        # features (gate_up's up rows, by down's scales), B's rows are divided by these.
        self.input_scales: torch.Tensor | None = None
        self.output_divisors: torch.Tensor | None = None
        self.params = ProjectionParams()  # the LoRA fields alone, for kernels.lora_add
        self.fill_params(self.params)

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
                if self.input_scales is not None:
                    a = a.float() * self.input_scales.to(a.device)
                if self.output_divisors is not None:
                    divisors = self.output_divisors[row : row + features].to(b.device)
                    b = b.float() / divisors[:, None]
                self.lora_a[cols.start : cols.start + rank] = a.to(self.lora_a.dtype)
                self.lora_bt[cols.start : cols.start + rank, row : row + features] = b.T.to(
                    self.lora_bt.dtype
                )
            row += features

    def clear(self, slot: int) -> None:
        for part in range(len(self.part_features)):
            cols = self._columns(part, slot)
            self.lora_a[cols] = 0
            self.lora_bt[cols] = 0

    def add_to(
        self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """y (the base projection of x) plus the deltas of the rows under adapters."""
        if (
            self.kernels is not None
            and slots is not None
            and x.dtype == y.dtype == torch.bfloat16
            and x.dim() == y.dim() == 2
        ):
            y = y.contiguous()
            self.kernels.lora_add(x.contiguous(), y, self.params, slots)
            return y
        return y + self(x, mask).to(y.dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The delta of x [rows, in] under `mask` [rows, slots * rank] (see the class)."""
        shrunk = x.to(self.lora_a.dtype) @ self.lora_a.T
        parts = len(self.part_features)
        scaled = shrunk * (mask if parts == 1 else mask.repeat(1, parts))
        return scaled @ self.lora_bt

    def fill_params(self, params: ProjectionParams) -> None:
        """Point the C decode layer's projection at these slots (float32 only: its form)."""
        if self.lora_a.dtype != torch.float32 or self.lora_a.device.type != "cpu":
            return
        params.lora_a, params.lora_bt = self.lora_a.data_ptr(), self.lora_bt.data_ptr()
        params.lora_parts, params.lora_slots = len(self.part_features), self.slots
        params.lora_rank = self.rank
        params.lora_part_rows = self.part_rows.data_ptr()
