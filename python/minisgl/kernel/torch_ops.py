"""Pure-PyTorch versions of the small ops the engine needs."""

from __future__ import annotations

import torch


def fast_compare_key(x: torch.Tensor, y: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D integer tensors (index of the first difference)."""
    n = min(len(x), len(y))
    diff = (x[:n] != y[:n]).nonzero()
    return int(diff[0, 0]) if len(diff) > 0 else n
