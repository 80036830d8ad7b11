"""Attention backends, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from minisgl.utils import Registry

from .base import BaseAttnBackend
from .torch_backend import TorchAttnBackend

ATTN_BACKENDS: Registry[Callable[..., BaseAttnBackend]] = Registry("attention backend")
ATTN_BACKENDS.register("torch")(TorchAttnBackend)

__all__ = ["ATTN_BACKENDS", "BaseAttnBackend", "TorchAttnBackend"]
