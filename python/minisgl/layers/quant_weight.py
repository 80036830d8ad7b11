"""A quantized weight as the quantized projections hold it: small integers and a float scale
(and optionally a float offset) per group of consecutive input columns of each output row. One
layout for every source (quantized at load, GGUF blocks, compressed-tensors), so one kernel
multiplies them all; each source repacks into it once, exactly (no value changes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# 4-bit values are stored in blocks of this many columns, two to a byte.
NIBBLE_BLOCK = 64


@dataclass
class QuantizedWeight:
    """A weight [out_features, in_features]: column k of row n is
    `values[n, k] * scales[n, k // group] + mins[n, k // group]` (no `mins`: + 0), computed in
    float32 (GGUF's dequantization, in the same order; every source's scales have few enough
    significant bits that the product is exact, so the kernels' fused multiply-add agrees).

    bits 8: `values` int8 [N, K]. bits 4: `values` uint8 [N, K // 2], values 0..15 packed in
    blocks of 64 columns, byte j of a block holding column j in its low nibble and column j + 32
    in its high one (K a multiple of 64). `scales` / `mins`: float16 or float32 (one dtype for
    both) [N, K // group]; group divides K, a multiple of 16 for 8 bits, of 32 for 4."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int

    def __post_init__(self) -> None:
        rows = self.values.shape[0]
        cols = self.values.shape[1] * (2 if self.bits == 4 else 1)
        if self.bits not in (4, 8):
            raise ValueError(f"QuantizedWeight: bits must be 4 or 8, got {self.bits}")
        want_dtype = torch.uint8 if self.bits == 4 else torch.int8
        if self.values.dtype != want_dtype or self.values.dim() != 2:
            raise ValueError(
                f"QuantizedWeight: {self.bits}-bit values must be 2-D {want_dtype}, got "
                f"{self.values.dtype} {tuple(self.values.shape)}"
            )
        min_group = 32 if self.bits == 4 else 16
        if self.group <= 0 or self.group % min_group or cols % self.group:
            raise ValueError(
                f"QuantizedWeight: group {self.group} must be a multiple of {min_group} "
                f"dividing in_features {cols}"
            )
        if self.bits == 4 and cols % NIBBLE_BLOCK:
            raise ValueError(f"QuantizedWeight: 4-bit in_features {cols} is not a multiple of 64")
        want = (rows, cols // self.group)
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is None:
                continue
            if tuple(t.shape) != want or t.dtype not in (torch.float16, torch.float32):
                raise ValueError(
                    f"QuantizedWeight: {name} must be float16/float32 {want}, got "
                    f"{t.dtype} {tuple(t.shape)}"
                )
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError("QuantizedWeight: scales and mins must share a dtype")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        """Bytes held: values, scales and mins."""
        tensors = [self.values, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    def integers(self) -> torch.Tensor:
        """The values as int16 [N, K] in column order (4-bit: unpacked, 0..15)."""
        if self.bits == 8:
            return self.values.to(torch.int16)
        rows, blocks = self.out_features, self.in_features // NIBBLE_BLOCK
        packed = self.values.view(rows, blocks, NIBBLE_BLOCK // 2).to(torch.int16)
        return torch.cat((packed & 15, packed >> 4), dim=2).view(rows, self.in_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (only `rows`, a tensor of row indices, where given)."""
        weight = self if rows is None else self._select(rows)
        return dequantize_groups(weight.integers(), weight.scales, weight.mins, self.group)

    def _select(self, rows: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(
            self.values[rows],
            self.scales[rows],
            None if self.mins is None else self.mins[rows],
            self.bits,
            self.group,
        )

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """These rows (e.g. a permutation), as a new weight."""
        return self._select(index)


def dequantize_groups(
    integers: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int
) -> torch.Tensor:
    """float32 [N, K] from integers [N, K] and scales (and mins) [N, K // group]: each integer
    times its group's scale, plus its min, in float32 (every weight layout's one definition)."""
    rows, cols = integers.shape
    weight = integers.float().view(rows, cols // group, group) * scales.float()[:, :, None]
    if mins is not None:
        weight = weight + mins.float()[:, :, None]
    return weight.view(rows, cols)


def pack_nibbles(integers: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] in QuantizedWeight's 4-bit layout from integers 0..15 [N, K]."""
    rows, cols = integers.shape
    if cols % NIBBLE_BLOCK:
        raise ValueError(f"pack_nibbles: {cols} columns is not a multiple of {NIBBLE_BLOCK}")
    blocks = integers.to(torch.uint8).view(rows, -1, 2, NIBBLE_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def as_8bit(weight: QuantizedWeight, group: int | None = None) -> QuantizedWeight:
    """The same values in the 8-bit layout (exact), with scales repeated down to `group`
    columns where given (a divisor of the weight's group)."""
    values = weight.integers().to(torch.int8)
    scales, mins = weight.scales, weight.mins
    if group is not None and group != weight.group:
        if weight.group % group:
            raise ValueError(f"as_8bit: group {group} does not divide {weight.group}")
        repeat = weight.group // group
        scales = scales.repeat_interleave(repeat, dim=1)
        mins = None if mins is None else mins.repeat_interleave(repeat, dim=1)
    return QuantizedWeight(values.contiguous(), scales, mins, 8, group or weight.group)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacked rows (a fused qkv or gate_up), exactly: parts in different layouts meet in the
    8-bit one, at the smallest group, float32 scales and mins where any part has them."""
    first = parts[0]
    same = all(
        (p.bits, p.group, p.scales.dtype, p.mins is None)
        == (first.bits, first.group, first.scales.dtype, first.mins is None)
        for p in parts
    )
    if not same:
        group = min(p.group for p in parts)
        scale_dtype = (
            torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else torch.float16
        )
        with_mins = any(p.mins is not None for p in parts)
        unified = []
        for part in parts:
            eight = as_8bit(part, group)
            mins = eight.mins
            if with_mins and mins is None:
                mins = torch.zeros_like(eight.scales)
            unified.append(
                QuantizedWeight(
                    eight.values,
                    eight.scales.to(scale_dtype),
                    None if mins is None else mins.to(scale_dtype),
                    8,
                    group,
                )
            )
        parts = unified
        first = parts[0]
    return QuantizedWeight(
        torch.cat([p.values for p in parts]).contiguous(),
        torch.cat([p.scales for p in parts]).contiguous(),
        None if first.mins is None else torch.cat([p.mins for p in parts]).contiguous(),
        first.bits,
        first.group,
    )


def narrow(weight: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight | None:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a weight, exactly (a
    tensor-parallel shard); None where the columns cut a group. 4-bit columns that are not
    whole 64-column blocks keep their values in the 8-bit layout."""
    size = weight.out_features if dim == 0 else weight.in_features
    if dim not in (0, 1) or start < 0 or length < 1 or start + length > size:
        what = "rows" if dim == 0 else "columns" if dim == 1 else f"dim {dim}"
        shape = (weight.out_features, weight.in_features)
        raise ValueError(f"narrow: {what} [{start}, {start + length}) of a {shape} weight")
    if dim == 0:
        return weight.rows(torch.arange(start, start + length))
    group = weight.group
    if start % group or length % group:
        return None
    groups = slice(start // group, (start + length) // group)
    integers = weight.integers()[:, start : start + length]
    if weight.bits == 4 and length % NIBBLE_BLOCK == 0:
        values, bits = pack_nibbles(integers), 4
    else:
        values, bits = integers.to(torch.int8).contiguous(), 8
    mins = None if weight.mins is None else weight.mins[:, groups].contiguous()
    return QuantizedWeight(values, weight.scales[:, groups].contiguous(), mins, bits, group)


def quantize_int8(
    weight: torch.Tensor,
    group: int | None = None,
    limit: int = 127,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedWeight:
    """Symmetric int8 with a scale (float32, or `scale_dtype`) per `group` columns (None: per
    output row): the group's largest magnitude maps to `limit` (31: 6-bit integers, which tile
    in 6 bits)."""
    out_features, in_features = weight.shape
    group = group or in_features
    w = weight.float().view(out_features, -1, group)
    scales = (w.abs().amax(dim=2) / float(limit)).to(scale_dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(w / scales.float()[:, :, None]).clamp_(-limit, limit).to(torch.int8)
    return QuantizedWeight(values.view(out_features, -1).contiguous(), scales, None, 8, group)


def quantize_int4(weight: torch.Tensor, group: int = 128) -> QuantizedWeight:
    """Asymmetric 4-bit with a float16 scale and offset per `group` columns (Q4_1's scheme):
    the group's range [min, max] maps to 0..15."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, -1, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = ((high - low) / 15.0).to(torch.float16)
    mins = low.to(torch.float16)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).float()
    integers = torch.round((w - mins.float()[:, :, None]) / safe[:, :, None]).clamp_(0, 15)
    integers = integers.view(out_features, in_features)
    if in_features % NIBBLE_BLOCK:  # the 8-bit layout holds the same 4-bit values
        return QuantizedWeight(integers.to(torch.int8).contiguous(), scales, mins, 8, group)
    return QuantizedWeight(pack_nibbles(integers), scales, mins, 4, group)
