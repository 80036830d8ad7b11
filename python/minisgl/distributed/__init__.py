"""Tensor parallelism: `comm` (process groups, the collectives behind core.TensorParallel, the
step broadcast) sits below the engine, which imports it; `worker` (the other ranks' processes)
sits above the engine and only the scheduler imports it."""

from .comm import ReplicaStep, StepMessage, TPGroup

__all__ = ["ReplicaStep", "StepMessage", "TPGroup"]
