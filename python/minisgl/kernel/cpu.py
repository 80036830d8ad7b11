"""CPU kernels in C (`csrc/`, one shared library), built once per machine with gcc and called via
ctypes: the loader, and `CpuKernels` assembled from the per-concept wrappers (gemm, attention,
elementwise, sampling, fused_layer).

`cpu_kernels()` returns None when they cannot be used (no compiler, not x86/Linux, or
MINISGL_CPU_KERNELS=0); `kernel/ops.py` then dispatches to the pure-PyTorch ops, which compute
the same thing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import shutil

from minisgl.env import ENV
from minisgl.kernel.abi import (
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_INTERMEDIATE,
    MAX_NORM_HIDDEN,
    DecodeLayerParams,
    DecodeModelParams,
    ProjectionParams,
)
from minisgl.kernel.attention import AttentionKernels
from minisgl.kernel.build import NATIVE_FLAGS, TARGETS, build_library, can_run
from minisgl.kernel.elementwise import ElementwiseKernels
from minisgl.kernel.fused_layer import FusedLayerKernels
from minisgl.kernel.gemm import GemmKernels
from minisgl.kernel.quantized import QuantizedKernels
from minisgl.kernel.sampling import SamplingKernels
from minisgl.kernel.threads import NO_CAP, kernel_threads, set_thread_cap

logger = logging.getLogger(__name__)

__all__ = ["MAX_GROUP", "MAX_HEAD_DIM", "MAX_INTERMEDIATE", "MAX_NORM_HIDDEN"]
__all__ += ["CpuKernels", "DecodeLayerParams", "DecodeModelParams", "ProjectionParams"]
__all__ += ["cpu_kernels"]
__all__ += ["NO_CAP", "kernel_threads", "set_thread_cap"]


# The machine's own build (tests/test_kernel_build.py builds it directly).
_build = build_library


class CpuKernels(
    GemmKernels,
    QuantizedKernels,
    FusedLayerKernels,
    AttentionKernels,
    ElementwiseKernels,
    SamplingKernels,
):
    """Typed wrappers over the C kernels; every tensor must be contiguous and on the CPU. Shapes
    a kernel cannot take raise ValueError, a failed C allocation MemoryError."""


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The built kernels, or None (with the reason logged once) when they are unavailable."""
    if not ENV.CPU_KERNELS.value:
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU kernels: not built on %s/%s", platform.system(), platform.machine())
        return None
    if shutil.which("gcc") is None:
        logger.warning("CPU kernels: gcc not found; using the PyTorch fallbacks")
        return None
    try:
        flags = target_flags(ENV.CPU_TARGET.value)
        return CpuKernels(ctypes.CDLL(str(_build(flags, sanitize=ENV.CPU_SANITIZE.value))))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernels unavailable, using the PyTorch fallbacks: %s", exc)
        return None


def target_flags(name: str) -> tuple[str, ...]:
    """gcc's target flags for MINISGL_CPU_TARGET: "native", or a build.TARGETS name this CPU runs."""
    if name == "native":
        return NATIVE_FLAGS
    target = next((t for t in TARGETS if t.name == name), None)
    if target is None:
        names = ["native", *(t.name for t in TARGETS)]
        raise ValueError(f"MINISGL_CPU_TARGET={name!r}: choose one of {names}")
    if not can_run(target):
        raise RuntimeError(f"MINISGL_CPU_TARGET={name!r}: this CPU cannot run that build")
    return target.flags
