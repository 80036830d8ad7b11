"""Tensor parallelism: `comm` (process groups, the layers' collectives, the step broadcast) is
imported by the engine and, for its type, the layers; `worker` (the other ranks' processes)
sits above the engine and is imported by the scheduler only."""

from .comm import TPGroup, vocab_range

__all__ = ["TPGroup", "vocab_range"]
