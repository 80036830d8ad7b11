"""Small helpers shared by every layer of the package."""

from .logging import init_logger
from .misc import align_down, align_up, div_ceil, vocab_range
from .registry import Registry

__all__ = ["Registry", "align_down", "align_up", "div_ceil", "init_logger", "vocab_range"]
