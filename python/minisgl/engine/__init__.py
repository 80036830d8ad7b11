"""The per-rank engine: model, KV pool, attention backend and sampler."""

from .config import EngineConfig
from .engine import Engine, ForwardInput, ForwardOutput
from .sample import SampleArgs, Sampler

__all__ = ["Engine", "EngineConfig", "ForwardInput", "ForwardOutput", "SampleArgs", "Sampler"]
