"""Scheduling: admission, batching, KV page management and the per-request lifecycle."""

from .cache import CacheManager
from .config import SchedulerConfig
from .output import SchedulerStats, TokenOutput
from .policy import SCHEDULE_POLICIES
from .scheduler import Scheduler
from .table import TableManager

__all__ = [
    "CacheManager",
    "SCHEDULE_POLICIES",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "TableManager",
    "TokenOutput",
]
