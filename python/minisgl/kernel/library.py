"""The loaded C library, the base of every part of CpuKernels: each exported function's ctypes
prototype bound (abi.py), and what this build and this CPU run."""

from __future__ import annotations

import ctypes

import torch

from minisgl.env import ENV
from minisgl.kernel.abi import DTYPE_CODES, RESTYPES, SIGNATURES


class KernelLibrary:
    """One build of the C kernels, loaded: `lib` with its prototypes set, and its features."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = RESTYPES[name]
        self.has_avx512_bf16 = bool(lib.minisgl_has_avx512_bf16())
        # AVX2 + FMA: the quantized row layout's float32 kernels (csrc/quantized_avx2.c).
        self.has_avx2 = bool(lib.minisgl_has_avx2())
        # The packed (tile-layout) bf16 matmuls: vdpbf16ps or the AMX tiles, else AVX2's FMA on
        # the same copy (csrc/matmul_avx2.c).
        self.has_packed_matmul = self.has_avx512_bf16 or self.has_avx2
        # AVX-512 F/BW/VL/DQ (natively or emulated): the 512-bit forms of every kernel.
        self.has_avx512 = bool(lib.minisgl_has_avx512())
        # vpdpbusd: quantized weights take the tile layout and int8 activations (quant_tiles.py).
        self.has_vnni = bool(lib.minisgl_has_vnni())
        # The tile layout's readers: vpdpbusd's int8 products, else AVX2's int8 and int16 ones
        # (csrc/quantized_tiled_avx2*.c).
        self.reads_tiles = self.has_vnni or self.has_avx2
        # Built with the tile instructions and granted the tile state by the kernel.
        self.has_amx = ENV.CPU_AMX.value and bool(lib.minisgl_has_amx())
        # And the int8 tiles (AMX-INT8: every CPU with AMX so far): W8A8 prefill matmuls.
        self.has_amx_int8 = self.has_amx and bool(lib.minisgl_has_amx_int8())

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether the kernels take tensors of this dtype (float32 and bfloat16)."""
        return dtype in DTYPE_CODES
