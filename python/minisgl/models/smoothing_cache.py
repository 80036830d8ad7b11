"""int8 smoothing's scales kept between starts: the first start calibrates, smooths and writes
each smoothed projection's scales to the cache; later starts apply them as the weights load, so
no projection is quantized twice and nothing is calibrated. Named by the model folder's path,
then keyed by the checkpoint's files (path, size, modification time), the kernels'
capabilities and the smoothing's settings; writing a folder's scales removes its older ones. Any
positive scales leave the model exact (1/s and s fold into neighbours), so a stale file could
cost quality, never correctness; unsharded engines only (tensor-parallel ranks would have to
agree on whether to calibrate, collective by collective)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minisgl.env import ENV
from minisgl.kernel.cpu import CpuKernels
from minisgl.utils import init_logger
from minisgl.utils.hf import cache_dir, short_digest

from .smoothing import CALIBRATION_SEED, CALIBRATION_TOKENS, SMOOTHING_ALPHA
from .weight import safetensors_files

logger = init_logger(__name__)

SCALES_VERSION = 1


def _kernels_tag(kernels: CpuKernels | None) -> list[bool] | None:
    """What decides which projections round x per 32 columns (and so are smoothed)."""
    if kernels is None:
        return None
    return [
        kernels.has_vnni,
        kernels.has_amx_int8,
        kernels.reads_tiles,
        kernels.has_avx512_bf16,
        kernels.has_avx2,
        ENV.CPU_INT8_ACTIVATIONS.value,
    ]


def scales_file(
    model_dir: str | Path, gguf_path: str | Path | None, kernels: CpuKernels | None
) -> Path:
    """Where the scales of this checkpoint smoothed on these kernels live."""
    files = [Path(gguf_path)] if gguf_path is not None else safetensors_files(Path(model_dir))
    sources = []
    for file in files:
        stat = file.stat()
        sources.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    settings = [SCALES_VERSION, SMOOTHING_ALPHA, CALIBRATION_TOKENS, CALIBRATION_SEED]
    place = short_digest(str(Path(model_dir).resolve()))
    version = short_digest(json.dumps([sources, _kernels_tag(kernels), settings]))
    return cache_dir() / "smoothing" / f"{Path(model_dir).name}-{place}{version}.safetensors"


def _remove_older_scales(path: Path) -> None:
    """Delete the other scales of path's model folder: its checkpoint or settings since
    changed (or another CPU's), so never read again here."""
    place = path.name[: -len(".safetensors") - 8]
    for old in path.parent.glob(f"{place}*.safetensors"):
        if old != path and len(old.name) == len(path.name):
            old.unlink(missing_ok=True)


def load_scales(path: Path) -> dict[str, torch.Tensor] | None:
    """The scales written for this key (projection name -> float32 per input channel), or None
    (not written yet, or unreadable: calibrated again and rewritten)."""
    if not path.exists():
        return None
    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file: calibrate again
        logger.warning("int8 smoothing: ignoring unreadable %s (%s)", path, exc)
        return None


def save_scales(path: Path, scales: dict[str, torch.Tensor]) -> None:
    """Write the scales atomically (a reader sees the whole file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        save_file({name: s.contiguous() for name, s in scales.items()}, str(staging))
        staging.replace(path)
        _remove_older_scales(path)
    except OSError as exc:  # a read-only cache costs the next start a calibration
        staging.unlink(missing_ok=True)
        logger.warning("int8 smoothing: scales not cached at %s (%s)", path, exc)
