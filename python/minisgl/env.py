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
    """One setting: read once from `MINISGL_<name>`, overridable in code via `.value`; `help`
    says what it does (docs/reference/environment.md is written from it)."""

    def __init__(self, name: str, default: T, parse: Callable[[str], T], help: str = "") -> None:
        self.name, self.default, self.help = f"MINISGL_{name}", default, help
        raw = os.environ.get(self.name)
        try:
            self.value: T = default if raw is None else parse(raw)
        except ValueError as exc:
            raise ValueError(f"bad value for {self.name}: {exc}") from exc

    def __repr__(self) -> str:
        return f"{self.name}={self.value!r}"


class _Env:
    def __init__(self) -> None:
        self.DISABLE_OVERLAP_SCHEDULING = EnvVar(
            "DISABLE_OVERLAP_SCHEDULING",
            False,
            _parse_bool,
            "run each step after the previous one is processed (no overlap scheduling)",
        )
        self.CACHE_DIR = EnvVar(
            "CACHE",
            Path(os.path.expanduser("~/.cache/minisgl")),
            lambda s: Path(s),
            "where models, converted GGUF files and built kernels are kept",
        )
        self.MEMORY_RATIO = EnvVar(
            "MEMORY_RATIO",
            0.9,
            float,
            "fraction of free host memory given to the KV pool on CPU (GPU: of free device memory)",
        )
        self.CPU_KV_CACHE_GB = EnvVar(
            "CPU_KV_CACHE_GB", 4.0, float, "the most GiB of KV pool on a CPU"
        )
        self.NUM_THREADS = EnvVar(
            "NUM_THREADS",
            0,
            int,
            "the engine's CPU threads at most (0: one per available core); tensor-parallel "
            "ranks share them (engine/cpu_threads.py)",
        )
        self.ADAPTIVE_THREADS = EnvVar(
            "ADAPTIVE_THREADS",
            True,
            _parse_bool,
            "fewer engine threads while other processes keep cores busy",
        )
        self.CPU_KERNELS = EnvVar(
            "CPU_KERNELS", True, _parse_bool, "the C kernels for CPU work (0: plain PyTorch)"
        )
        self.CPU_AMX = EnvVar(
            "CPU_AMX",
            True,
            _parse_bool,
            "the AMX matmul for 5-1023 rows where the CPU has tiles (0: oneDNN)",
        )
        self.CPU_INT8_SMOOTHING = EnvVar(
            "CPU_INT8_SMOOTHING",
            True,
            _parse_bool,
            "`int8` where activations are rounded to int8 per 32 columns (VNNI): SmoothQuant's "
            "per-channel smoothing, calibrated by a short prefill at start (models/smoothing.py)",
        )
        self.CPU_INT8_ACTIVATIONS = EnvVar(
            "CPU_INT8_ACTIVATIONS",
            True,
            _parse_bool,
            "quantized weights' bf16 activations rounded to int8 per 32 columns (one pass) at "
            "every decode batch: VNNI's tiles, and AVX2's for 4- and 6-bit weights up to 16 rows "
            "(0: kept to 16 bits, as precise as bf16, slower from 2 rows)",
        )
        self.CPU_TARGET = EnvVar(
            "CPU_TARGET",
            "native",
            str,
            "the C kernels' instruction set: native (-march=native) or a kernel.build.TARGETS "
            "name, e.g. x86-64-v3 to run as an AVX2-only machine",
        )
        self.CPU_SANITIZE = EnvVar(
            "CPU_SANITIZE",
            False,
            _parse_bool,
            "the C kernels built under ASan and UBSan (start with LD_PRELOAD of libasan)",
        )
        self.LOG_LEVEL = EnvVar("LOG_LEVEL", "INFO", str, "the processes' logging level")
        self.TP_TIMEOUT = EnvVar(
            "TP_TIMEOUT",
            300.0,
            float,
            "seconds a tensor-parallel rank waits in one collective (or for the ranks to "
            "start) before it gives up",
        )

    def variables(self) -> list[EnvVar]:
        """Every setting, in definition order."""
        return [v for v in vars(self).values() if isinstance(v, EnvVar)]


ENV = _Env()
