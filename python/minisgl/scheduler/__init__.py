"""Scheduling: admission, batching, KV page management and the per-request lifecycle."""

from .cache import CacheManager
from .config import SchedulerConfig
from .scheduler import CacheStats, Scheduler, TokenOutput
from .table import TableManager

__all__ = [
    "CacheManager",
    "CacheStats",
    "Scheduler",
    "SchedulerConfig",
    "TableManager",
    "TokenOutput",
]
