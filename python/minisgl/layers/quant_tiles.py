"""A QuantizedWeight re-laid-out for the C kernels' tiled int8 matmul (csrc/quantized_tiled.c):
16 weight rows a tile, 4 columns of each row a 32-bit lane, so AVX-512 VNNI multiplies 16 rows
by 4 columns of int8 activations a step with nothing transposed at run time. The values stay
the same integers, the scales and mins the same floats: only their order changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant_weight import QuantizedWeight, dequantize_groups

TILE_ROWS = 16


def fits_6_bits(weight: QuantizedWeight) -> bool:
    """Whether an 8-bit weight tiles in 6 bits: integers within -32..31 (Q6_K, Q5_0/Q5_1/Q5_K
    values, a Q4_K_M file's mixed projections, the int4 method's output head)."""
    if weight.bits != 8:
        return False
    return int(weight.values.min()) >= -32 and int(weight.values.max()) <= 31


def tiles_fit(weight: QuantizedWeight) -> bool:
    """Whether the tile layout takes this weight: whole 32-column activation blocks."""
    return weight.in_features % 32 == 0


@dataclass(frozen=True)
class TiledWeight:
    """values: uint8, 8 bits [tiles, K/4, 64] (+128), 4 bits [tiles, K/32, 4, 64] (two
    columns 16 apart a byte), 6 bits [tiles, K/32, 6, 64] (+32: the low 4 bits as 4 bits', then
    the top 2 bits of columns 16h + 4j + i in bits 2j..2j+1 of byte i of lane l of vector 4 + h);
    scales/mins [tiles, groups, 16] in the source's float dtype. Rows past out_features are
    zeros. bits 6 holds an 8-bit weight whose integers fit -32..31."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held: values, scales and mins (padding rows included)."""
        tensors = [self.values, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    def integers(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integers as int16 [N, K] in column order, as the source QuantizedWeight's
        `integers()` gives them (4 bits: 0..15; 6 and 8 bits: signed), padding rows dropped
        (only `rows`, a tensor of row indices, where given)."""
        cols = self.in_features
        if self.bits == 8:  # [tiles, K/4, 16 l, 4 i]: byte 4l+i of quad q
            quads = self._per_row(self.values.view(-1, cols // 4, TILE_ROWS, 4), 2, rows)
            return quads.reshape(quads.shape[0], cols).to(torch.int16) - 128
        vectors = self.values.shape[2]  # 4, or 6 (two more: the top 2 bits)
        # [tiles, K/32 c, vectors, 16 l, 4 i] -> [R, c, vectors, 4 i]
        lanes = self._per_row(self.values.view(-1, cols // 32, vectors, TILE_ROWS, 4), 3, rows)
        packed = lanes[:, :, :4]  # [R, c, 4 j, 4 i]: columns 4j+i low, 16+4j+i high
        ints = torch.stack((packed & 15, packed >> 4), dim=2)  # [R, c, 2 h, 4 j, 4 i]
        if self.bits == 6:  # byte i of vector 4 + h: column 16h+4j+i's top 2 bits at 2j
            crumbs = lanes[:, :, 4:6]  # [R, c, 2 h, 4 i]
            tops = torch.stack([(crumbs >> 2 * j) & 3 for j in range(4)], dim=3)
            ints = ints | (tops << 4)
        ints = ints.reshape(lanes.shape[0], cols).to(torch.int16)
        return ints - 32 if self.bits == 6 else ints

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [N, K], padding rows dropped (only `rows`, a tensor of row
        indices, where given): QuantizedWeight.dequantize's values, bit for bit."""
        scales = self._per_row(self.scales, 2, rows)
        mins = None if self.mins is None else self._per_row(self.mins, 2, rows)
        return dequantize_groups(self.integers(rows), scales, mins, self.group)

    def _per_row(
        self, table: torch.Tensor, lane_dim: int, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """`table` [tiles, ..., 16 (dim lane_dim), ...] as [N (or len(rows)), ...]: row
        16t + l's entries first (negative indices count from out_features, as a tensor's do;
        padding rows are out of range)."""
        count = self.out_features
        if rows is None:
            per_row = table.movedim(lane_dim, 1)
            return per_row.reshape(-1, *per_row.shape[2:])[:count]
        index = rows.reshape(-1).long()
        if index.numel() and (int(index.min()) < -count or int(index.max()) >= count):
            bad = index[(index < -count) | (index >= count)][0]
            raise IndexError(f"TiledWeight: row {int(bad)} is out of range for {count} rows")
        index = torch.where(index < 0, index + count, index)
        between = (slice(None),) * (lane_dim - 1)
        return table[(index // TILE_ROWS, *between, index % TILE_ROWS)]


def _tiled_groups(table: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, groups] -> [tiles, groups, 16], zero rows appended."""
    padded = table.new_zeros(tiles * TILE_ROWS, table.shape[1])
    padded[: table.shape[0]] = table
    return padded.view(tiles, TILE_ROWS, -1).transpose(1, 2).contiguous()


def _stored_bytes(weight: QuantizedWeight, bits: int, tiles: int) -> torch.Tensor:
    """uint8 [tiles * 16, K]: each integer plus the tile layout's offset (8 bits: 128, 6: 32, 4:
    none), rows past out_features holding integer 0. In uint8 from the start: the int16 passes
    took most of a load's tiling (the default model's head: 100 ms)."""
    rows, cols = weight.out_features, weight.in_features
    stored = torch.empty(tiles * TILE_ROWS, cols, dtype=torch.uint8)
    if weight.bits == 4:
        packed = weight.values.view(rows, cols // 64, 32)
        body = stored[:rows].view(rows, cols // 64, 2, 32)
        torch.bitwise_and(packed, 15, out=body[:, :, 0])
        torch.bitwise_right_shift(packed, 4, out=body[:, :, 1])
    else:  # int8 values: + 128 is a flip of the top bit; + 32 stays within int8 (-32..31)
        values = weight.values.view(torch.uint8)
        if bits == 8:
            torch.bitwise_xor(values, 128, out=stored[:rows])
        else:
            torch.add(weight.values, 32, out=stored[:rows].view(torch.int8))
    stored[rows:] = {8: 128, 6: 32, 4: 0}[bits]
    return stored


def tile_weight(weight: QuantizedWeight) -> TiledWeight:
    """`weight` in the tile layout (the caller checks tiles_fit)."""
    rows, cols = weight.out_features, weight.in_features
    tiles = -(-rows // TILE_ROWS)
    bits = 6 if weight.bits == 8 and fits_6_bits(weight) else weight.bits
    stored = _stored_bytes(weight, bits, tiles)
    if bits == 8:
        quads = stored.view(tiles, TILE_ROWS, cols // 4, 4)
        values = quads.transpose(1, 2).reshape(tiles, cols // 4, 64)
    else:
        # Per 32 columns: vector j holds columns 4j..4j+3 low and 4j+16..4j+19 high.
        chunks = stored.view(tiles, TILE_ROWS, cols // 32, 2, 4, 4)
        low = chunks & 15 if bits == 6 else chunks
        packed = low[:, :, :, 0] | (low[:, :, :, 1] << 4)  # [tiles, 16, K/32, 4 j, 4 i]
        vectors = [packed]
        if bits == 6:  # vector 4 + h: the top 2 bits of columns 16h + 4j + i, crumb j of byte i
            tops = chunks >> 4  # [tiles, 16, K/32, 2 h, 4 j, 4 i]
            crumbs = tops[:, :, :, :, 0] | (tops[:, :, :, :, 1] << 2)
            crumbs |= (tops[:, :, :, :, 2] << 4) | (tops[:, :, :, :, 3] << 6)
            vectors.append(crumbs)  # [tiles, 16, K/32, 2 h, 4 i]
        values = torch.cat(vectors, dim=3).permute(0, 2, 3, 1, 4)
        values = values.reshape(tiles, cols // 32, values.shape[2], 64)
    mins = None if weight.mins is None else _tiled_groups(weight.mins, tiles)
    return TiledWeight(
        values.contiguous(),
        _tiled_groups(weight.scales, tiles),
        mins,
        bits,
        weight.group,
        rows,
        cols,
    )
