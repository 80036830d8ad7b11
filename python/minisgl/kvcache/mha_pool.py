"""Multi-head KV pool: one K and one V buffer per layer, indexed by token slot."""

from __future__ import annotations

import torch

from minisgl.utils.memory import advise_huge_pages

from .base import BaseKVCache


def _zeroed_buffer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(buffer)  # before the zero fill touches the pages
    return buffer.zero_()


class MHAKVCache(BaseKVCache):
    """K/V buffers shaped [num_layers, num_slots, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self._k = _zeroed_buffer(shape, dtype, device)
        self._v = _zeroed_buffer(shape, dtype, device)
        self.num_slots = num_slots

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._k[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id]

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
        self._k[layer_id].index_copy_(0, out_loc, k)
        self._v[layer_id].index_copy_(0, out_loc, v)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V at `slots`, every layer: [num_layers, len(slots), heads, dim]."""
        index = slots.to(device=self._k.device, dtype=torch.int64)
        return self._k.index_select(1, index), self._v.index_select(1, index)

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V shaped as `gather` returns them into `slots`."""
        index = slots.to(device=self._k.device, dtype=torch.int64)
        self._k.index_copy_(1, index, k.to(self._k.device))
        self._v.index_copy_(1, index, v.to(self._v.device))

    @property
    def num_layers(self) -> int:
        return self._k.shape[0]

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
