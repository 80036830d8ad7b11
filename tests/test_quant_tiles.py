"""The tile layout (layers/quant_tiles.py) read back in plain torch: `tile_weight(w)` dequantizes
to `w.dequantize()` bit for bit, and gives back `w.integers()`, for every layout the tiles take
(8 bits in groups of 16, 32 and a whole row, 4 bits in groups of 32 and 64, 8-bit integers
within -32..31 in 6 bits, with and without mins, float16 and float32 scales) at every row count
from 1 to 40 (whole and partial tiles of 16) and K of 32 to 192 (odd and even counts of 32
columns). The layout itself is checked byte by byte against csrc/quantized_tiled.c's header
comment, so a wrong re-layout cannot hide behind its own inverse. Pure torch: runs on every CPU,
whether or not its kernels take the tiles (those need VNNI)."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers.quant_tiles import TILE_ROWS, TiledWeight, tile_weight, tiles_fit
from minisgl.layers.quant_weight import QuantizedWeight, pack_nibbles

COLUMNS = [32, 64, 96, 160, 192]
ROWS = range(1, 41)


def _floats(rows: int, groups: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Scales or mins of either sign from 2^-20 to 8, a few zeros, in `dtype`."""
    magnitude = torch.exp2(torch.rand(rows, groups, generator=gen) * 23 - 20)
    sign = torch.randint(0, 2, (rows, groups), generator=gen) * 2 - 1
    values = magnitude * sign * (torch.rand(rows, groups, generator=gen) > 0.05)
    return values.to(dtype)


def _weight(
    kind: str, rows: int, cols: int, group: int, with_mins: bool, dtype: torch.dtype, seed: int
) -> QuantizedWeight:
    """A random weight: kind "int8" (every integer, -128 too), "int4" (packed nibbles) or
    "int6" (8-bit integers within -32..31)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "int4":
        values = pack_nibbles(torch.randint(0, 16, (rows, cols), generator=gen))
    else:
        low, high = (-128, 128) if kind == "int8" else (-32, 32)
        values = torch.randint(low, high, (rows, cols), generator=gen, dtype=torch.int8)
    groups = cols // group
    scales = _floats(rows, groups, dtype, gen)
    mins = _floats(rows, groups, dtype, gen) if with_mins else None
    return QuantizedWeight(values, scales, mins, 4 if kind == "int4" else 8, group)


def _groups(kind: str, cols: int) -> list[int]:
    if kind == "int4":
        return [] if cols % 64 else [32, 64]
    return sorted({16, 32, cols})


CASES = [
    pytest.param(kind, cols, group, id=f"{kind}-K{cols}-g{group}")
    for kind in ("int8", "int4", "int6")
    for cols in COLUMNS
    for group in _groups(kind, cols)
]
# Scales' dtype and mins, taken in turn as the row count grows: each pair meets 10 row counts.
FLOATS = [
    (False, torch.float32),
    (True, torch.float16),
    (False, torch.float16),
    (True, torch.float32),
]


@pytest.mark.parametrize(("kind", "cols", "group"), CASES)
def test_tiled_weight_dequantizes_as_its_source(kind: str, cols: int, group: int) -> None:
    want_bits = {"int8": 8, "int4": 4, "int6": 6}[kind]
    for rows in ROWS:
        with_mins, dtype = FLOATS[rows % len(FLOATS)]
        weight = _weight(kind, rows, cols, group, with_mins, dtype, seed=rows * 1000 + cols)
        assert tiles_fit(weight)
        tiled = tile_weight(weight)
        assert tiled.bits == want_bits and (tiled.out_features, tiled.in_features) == (rows, cols)
        assert tiled.values.shape[0] == -(-rows // TILE_ROWS)  # partial tiles padded
        dense = weight.dequantize()
        got = tiled.dequantize()
        assert got.dtype == torch.float32 and got.shape == (rows, cols)
        assert torch.equal(got, dense), (rows, with_mins, dtype)
        # Bit for bit (a zero's sign too).
        assert torch.equal(got.view(torch.int32), dense.view(torch.int32)), rows
        assert torch.equal(tiled.integers(), weight.integers()), rows
        # Some rows, in any order, repeated, negative indices as a tensor's.
        gen = torch.Generator().manual_seed(rows)
        ids = torch.randint(-rows, rows, (7,), generator=gen)
        assert torch.equal(tiled.dequantize(ids), weight.dequantize(ids)), (rows, ids)
        assert torch.equal(tiled.integers(ids), weight.integers()[ids]), (rows, ids)
        none = torch.zeros(0, dtype=torch.long)
        assert torch.equal(tiled.dequantize(none), weight.dequantize(none))
        assert tiled.dequantize(none).shape == (0, cols)


def test_rows_past_out_features_are_refused() -> None:
    tiled = tile_weight(_weight("int8", 20, 64, 32, False, torch.float32, seed=1))
    for bad in (20, 31, -21):  # 20..31: the second tile's padding
        with pytest.raises(IndexError, match=f"row {bad} is out of range for 20 rows"):
            tiled.dequantize(torch.tensor([0, bad]))


def _header_integer(tiled: TiledWeight, n: int, k: int, values: list[int]) -> int:
    """Row n, column k's integer read as csrc/quantized_tiled.c's header comment lays it out
    (`values`: the tiled bytes, flat), one byte at a time."""
    cols = tiled.in_features
    t, lane = divmod(n, TILE_ROWS)
    if tiled.bits == 8:  # [tiles][K/4][64], byte 4l+i of quad q = q[16t+l, 4q+i] + 128
        q, i = divmod(k, 4)
        return values[(t * (cols // 4) + q) * 64 + 4 * lane + i] - 128
    vectors = 4 if tiled.bits == 4 else 6
    # [tiles][K/32][vectors][64]: byte 4l+i of vector j of chunk c holds column 32c+4j+i in its
    # low nibble, 32c+4j+16+i in its high one
    c, rest = divmod(k, 32)
    h, rest = divmod(rest, 16)
    j, i = divmod(rest, 4)

    def byte(vector: int) -> int:
        return values[((t * (cols // 32) + c) * vectors + vector) * 64 + 4 * lane + i]

    low = (byte(j) >> (4 * h)) & 15
    if tiled.bits == 4:
        return low
    # 6 bits (+32): vector 4 + h the top 2 bits of column 32c+16h+4j+i in bits 2j..2j+1
    top = (byte(4 + h) >> (2 * j)) & 3
    return (low | top << 4) - 32


@pytest.mark.parametrize("kind", ["int8", "int4", "int6"])
def test_the_layout_is_the_c_kernels(kind: str) -> None:
    """Every byte where the C kernels' header says it is: the integers, and the scales and mins
    [tiles][groups][16] (the 16 rows' values per group), padding rows zero."""
    rows, cols, group = 20, 128, 32
    weight = _weight(kind, rows, cols, group, True, torch.float16, seed=7)
    tiled = tile_weight(weight)
    values = tiled.values.flatten().tolist()
    ints = weight.integers().tolist()
    for n in range(rows):
        for k in range(cols):
            assert _header_integer(tiled, n, k, values) == ints[n][k], (n, k)
    padding = 2 * TILE_ROWS - rows
    for n in range(rows, rows + padding):
        assert all(_header_integer(tiled, n, k, values) == 0 for k in range(cols)), n
    for table, source in ((tiled.scales, weight.scales), (tiled.mins, weight.mins)):
        assert table is not None and source is not None
        assert table.shape == (2, cols // group, TILE_ROWS) and table.dtype == source.dtype
        for n in range(2 * TILE_ROWS):
            t, lane = divmod(n, TILE_ROWS)
            want = source[n] if n < rows else torch.zeros_like(source[0])
            assert torch.equal(table[t, :, lane], want), n
