"""Typed settings read from MINISGL_* environment variables: `ENV.NAME.value`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {raw!r}")


class EnvVar(Generic[T]):
    """One setting: read once from `MINISGL_<name>`, overridable in code via `.value`."""

    def __init__(self, name: str, default: T, parse: Callable[[str], T]) -> None:
        self.name = f"MINISGL_{name}"
        raw = os.environ.get(self.name)
        try:
            self.value: T = default if raw is None else parse(raw)
        except ValueError as exc:
            raise ValueError(f"bad value for {self.name}: {exc}") from exc

    def __repr__(self) -> str:
        return f"{self.name}={self.value!r}"


class _Env:
    def __init__(self) -> None:
        self.DISABLE_OVERLAP_SCHEDULING = EnvVar("DISABLE_OVERLAP_SCHEDULING", False, _parse_bool)
        self.CACHE_DIR = EnvVar(
            "CACHE", Path(os.path.expanduser("~/.cache/minisgl")), lambda s: Path(s)
        )
        # Fraction of free host memory given to the KV pool on CPU (GPU: of free device memory).
        self.MEMORY_RATIO = EnvVar("MEMORY_RATIO", 0.9, float)
        self.CPU_KV_CACHE_GB = EnvVar("CPU_KV_CACHE_GB", 4.0, float)
        # CPU threads of the engine: at most this many (0: one per available core), fewer while
        # other processes keep cores busy unless ADAPTIVE_THREADS is off (engine/cpu_threads.py);
        # tensor-parallel ranks share it (each takes 1/tp_size).
        self.NUM_THREADS = EnvVar("NUM_THREADS", 0, int)
        self.ADAPTIVE_THREADS = EnvVar("ADAPTIVE_THREADS", True, _parse_bool)
        # C kernels for CPU decode (kernel/cpu.py); 0 keeps every op in plain PyTorch.
        self.CPU_KERNELS = EnvVar("CPU_KERNELS", True, _parse_bool)
        # The AMX matmul for 5-1023 rows where the CPU has tiles; 0 leaves those to oneDNN.
        self.CPU_AMX = EnvVar("CPU_AMX", True, _parse_bool)
        # Quantized weights in the tile layout, met by int8-rounded activations (VNNI) up to 128
        # rows (with AMX: up to 9, bf16 on the tiles from 10); 0 keeps the row layout and bf16
        # activations (weight-only arithmetic, slower).
        self.CPU_INT8_ACTIVATIONS = EnvVar("CPU_INT8_ACTIVATIONS", True, _parse_bool)
        # The C kernels' instruction set: "native" (-march=native) or a kernel.build.TARGETS name,
        # e.g. x86-64-v3 to run this machine as an AVX2-only one, or avx512-bf16-amx-emulated
        # to run it as a Xeon with AMX (slowly: for tests).
        self.CPU_TARGET = EnvVar("CPU_TARGET", "native", str)
        # The C kernels built under ASan and UBSan (the process must start with
        # LD_PRELOAD=$(gcc -print-file-name=libasan.so); tests/test_kernel_sanitized.py).
        self.CPU_SANITIZE = EnvVar("CPU_SANITIZE", False, _parse_bool)
        self.LOG_LEVEL = EnvVar("LOG_LEVEL", "INFO", str)
        # Tensor parallelism: seconds a rank waits in one step's collective (or for the ranks
        # to start) before it gives up, so that a dead or stuck rank never hangs the others.
        self.TP_TIMEOUT = EnvVar("TP_TIMEOUT", 300.0, float)


ENV = _Env()
