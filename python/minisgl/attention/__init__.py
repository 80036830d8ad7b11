"""Attention backends, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.kernel.cpu import cpu_kernels
from minisgl.kvcache import BaseKVCache
from minisgl.utils import Registry

from .base import BaseAttnBackend
from .cpu_backend import CpuAttnBackend
from .torch_backend import TorchAttnBackend

ATTN_BACKENDS: Registry[Callable[..., BaseAttnBackend]] = Registry("attention backend")
ATTN_BACKENDS.register("torch")(TorchAttnBackend)


@ATTN_BACKENDS.register("cpu")
def _cpu_backend(
    kv_cache: BaseKVCache, page_table: torch.Tensor, sliding_windows: tuple[int | None, ...]
) -> BaseAttnBackend:
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("attention backend 'cpu' needs the CPU kernels (see kernel/cpu.py)")
    return CpuAttnBackend(kv_cache, page_table, sliding_windows, kernels)


def default_attn_backend(device: torch.device) -> str:
    """'cpu' on a CPU whose C kernels built, else 'torch'."""
    return "cpu" if device.type == "cpu" and cpu_kernels() is not None else "torch"


__all__ = [
    "ATTN_BACKENDS",
    "BaseAttnBackend",
    "CpuAttnBackend",
    "TorchAttnBackend",
    "default_attn_backend",
]
