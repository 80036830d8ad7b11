"""Opening the disk KV tier for an engine: its fingerprint, and running on without the tier when
the directory is unusable."""

from __future__ import annotations

from minisgl.engine import Engine
from minisgl.env import ENV
from minisgl.kvcache import DiskKVTier, model_fingerprint
from minisgl.kvcache.tier_file import FORMAT_VERSION
from minisgl.layers.quantized import LOAD_QUANTIZATION_VERSION, LOAD_QUANTIZATIONS
from minisgl.models.smoothing import scales_digest
from minisgl.utils import init_logger

from .config import SchedulerConfig

logger = init_logger(__name__)


def tier_fingerprint(config: SchedulerConfig, engine: Engine) -> str:
    """Everything that decides what the KV of a token path is, and how it is laid out."""
    mc = engine.model_config
    settings = {
        "format": FORMAT_VERSION,
        "architecture": mc.architecture,
        "dtype": str(config.dtype),
        "page_size": config.page_size,
        "layers": mc.num_layers,
        "kv_heads": engine.num_kv_heads,
        "head_dim": mc.head_dim,
        "quantization": config.quantization,
        "quantized_at_load": (
            LOAD_QUANTIZATION_VERSION if config.quantization in LOAD_QUANTIZATIONS else None
        ),
        # Quantized weights meet int8-rounded activations, or bf16 ones: other KV values.
        "int8_activations": ENV.CPU_INT8_ACTIVATIONS.value,
        # int8 smoothing re-quantizes projections: other integers, other KV values.
        "smoothing": scales_digest(engine.smoothing_scales),
        "tp": [config.tp_rank, config.tp_size],
    }
    return model_fingerprint(config.model_path, config.gguf_path, settings)


def open_disk_tier(config: SchedulerConfig, engine: Engine) -> DiskKVTier | None:
    """The tier under `config.kv_cache_dir`, or None: none configured, or the directory cannot
    be used (logged; the engine then runs on its in-memory cache alone)."""
    if config.kv_cache_dir is None:
        return None
    try:
        return DiskKVTier(
            config.kv_cache_dir,
            tier_fingerprint(config, engine),
            engine.kv_cache,
            config.page_size,
            int(config.kv_cache_disk_gb * 2**30),
        )
    except OSError as exc:
        logger.warning(
            "kv_cache_dir %r cannot be used (%s): running without the disk KV tier",
            config.kv_cache_dir,
            exc,
        )
        return None
