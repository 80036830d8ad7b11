"""A QuantizedWeight re-laid-out for the C kernels' tiled int8 matmul (csrc/quantized_tiled.c):
16 weight rows a tile, 4 columns of each row a 32-bit lane, so AVX-512 VNNI multiplies 16 rows
by 4 columns of int8 activations a step with nothing transposed at run time. The values stay
the same integers, the scales and mins the same floats: only their order changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant_weight import QuantizedWeight

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


def _tiled_groups(table: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, groups] -> [tiles, groups, 16], zero rows appended."""
    padded = table.new_zeros(tiles * TILE_ROWS, table.shape[1])
    padded[: table.shape[0]] = table
    return padded.view(tiles, TILE_ROWS, -1).transpose(1, 2).contiguous()


def tile_weight(weight: QuantizedWeight) -> TiledWeight:
    """`weight` in the tile layout (the caller checks tiles_fit)."""
    rows, cols = weight.out_features, weight.in_features
    tiles = -(-rows // TILE_ROWS)
    ints = torch.zeros(tiles * TILE_ROWS, cols, dtype=torch.int16)
    ints[:rows] = weight.integers()
    bits = 6 if weight.bits == 8 and fits_6_bits(weight) else weight.bits
    if bits == 8:
        quads = (ints + 128).to(torch.uint8).view(tiles, TILE_ROWS, cols // 4, 4)
        values = quads.transpose(1, 2).reshape(tiles, cols // 4, 64)
    else:
        if bits == 6:
            ints = ints + 32
        # Per 32 columns: vector j holds columns 4j..4j+3 low and 4j+16..4j+19 high.
        chunks = ints.to(torch.uint8).view(tiles, TILE_ROWS, cols // 32, 2, 4, 4)
        low = chunks & 15
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
