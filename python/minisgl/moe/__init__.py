"""MoE backends: how a layer's experts run for the tokens the router sent them
(`layers.moe.ExpertsBackend`), by name; the model passes the chosen one to each MoE layer."""

from __future__ import annotations

from minisgl.layers.moe import ExpertsBackend
from minisgl.utils import Registry

from .torch_backend import grouped_experts

MOE_BACKENDS: Registry[ExpertsBackend] = Registry("MoE backend")
MOE_BACKENDS.register("torch")(grouped_experts)

__all__ = ["MOE_BACKENDS", "grouped_experts"]
