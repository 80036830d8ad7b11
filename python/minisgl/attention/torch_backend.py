"""Reference attention in plain PyTorch (CPU and CUDA): paged KV gathered into padded SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.core import Batch
from minisgl.kvcache import BaseKVCache

from .base import BaseAttnBackend


@dataclass
class TorchAttnMetadata:
    """Padded views of a varlen batch: request b's query j sits at row b * max_q + j."""

    kv_indices: torch.Tensor  # [B * max_kv] slot of each key position (padding: any valid slot)
    q_rows: torch.Tensor | None  # [tokens] padded row of each token; None when max_q == 1
    max_q: int
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, max_q, max_kv] bool
    # Heavily shared KV (radix hits): each distinct slot read once, all query tokens as one
    # sequence, and a [1, 1, tokens, slots] mask of which token may see which slot.
    shared_slots: torch.Tensor | None = None
    shared_mask: torch.Tensor | None = None
    # Request by request instead (few requests, or none with anything cached): each one's
    # extend_len, and for one with a cached prefix the KV slots of all its positions and a
    # bottom-right causal mask [extend_len, kv_len] (None: it attends to its new q/k/v as they
    # are, causally).
    extend_lens: list[int] | None = None
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None


class TorchAttnBackend(BaseAttnBackend):
    """Gathers each request's KV pages into a padded batch for SDPA.

    When at least `shared_kv_min_dup` of the gathered rows would be duplicates (many requests on
    one cached prefix), it reads each distinct slot once instead.
    """

    shared_kv_min_dup = 0.5
    # Prefill request by request (`_per_request_attention`) when no request has anything cached,
    # or when there are at most this many requests (and no heavily shared prefix).
    per_request_prefill = True
    per_request_max_reqs = 8

    def __init__(
        self,
        kv_cache: BaseKVCache,
        page_table: torch.Tensor,
        sliding_windows: tuple[int | None, ...],
    ) -> None:
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.sliding_windows = sliding_windows
        self.device = page_table.device

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.reqs
        device = self.device
        by_request = self.per_request_prefill and batch.is_prefill
        by_request = by_request and set(self.sliding_windows) == {None}
        if by_request and all(r.extend_len == r.device_len for r in reqs):
            batch.attn_metadata = self._per_request_metadata(batch)
            return
        seq_lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int64)
        extend_lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
        max_kv, max_q = int(seq_lens.max()), int(extend_lens.max())
        table_idx = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)
        kv_indices = self.page_table[table_idx, :max_kv].flatten().long()

        seq_lens, extend_lens = seq_lens.to(device), extend_lens.to(device)
        q_offsets = torch.arange(max_q, device=device)
        # Position of each padded query; padding rows get position 0 so no row is fully masked.
        q_pos = (seq_lens - extend_lens)[:, None] + q_offsets[None, :]
        q_valid = q_offsets[None, :] < extend_lens[:, None]
        q_pos = torch.where(q_valid, q_pos, 0)
        q_rows = None
        if max_q > 1:
            q_rows = (torch.arange(len(reqs), device=device)[:, None] * max_q + q_offsets)[q_valid]
        kv_pos = torch.arange(max_kv, device=device)
        causal = kv_pos[None, None, :] <= q_pos[:, :, None]
        masks: dict[int | None, torch.Tensor] = {None: causal.unsqueeze(1)}
        for window in set(self.sliding_windows) - {None}:
            assert window is not None
            in_window = kv_pos[None, None, :] > q_pos[:, :, None] - window
            masks[window] = (causal & in_window).unsqueeze(1)
        meta = TorchAttnMetadata(kv_indices, q_rows, max_q, masks)
        if len(reqs) > 1 and set(self.sliding_windows) == {None}:
            token_req = torch.arange(len(reqs), device=device)[:, None].expand_as(q_valid)
            kv_valid = kv_pos[None, :] < seq_lens[:, None]
            self._prepare_shared(meta, causal[q_valid], token_req[q_valid], kv_valid)
        if by_request and meta.shared_slots is None and len(reqs) <= self.per_request_max_reqs:
            meta = self._per_request_metadata(batch)
        batch.attn_metadata = meta

    def _per_request_metadata(self, batch: Batch) -> TorchAttnMetadata:
        extend_lens = [r.extend_len for r in batch.reqs]
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for r in batch.reqs:
            if r.extend_len == r.device_len:
                prefix_kv.append(None)
                continue
            slots = self.page_table[r.table_idx, : r.device_len].long()
            mask = torch.ones(r.extend_len, r.device_len, dtype=torch.bool, device=self.device)
            prefix_kv.append((slots, mask.tril(diagonal=r.device_len - r.extend_len)))
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return TorchAttnMetadata(
            empty, None, max(extend_lens), {}, extend_lens=extend_lens, prefix_kv=prefix_kv
        )

    def _prepare_shared(
        self,
        meta: TorchAttnMetadata,
        token_visible: torch.Tensor,
        token_req: torch.Tensor,
        kv_valid: torch.Tensor,
    ) -> None:
        """Switch to one-read-per-slot attention when many requests share cached pages.

        token_visible: [tokens, max_kv] the key positions each query token sees; token_req:
        [tokens] its request; kv_valid: [B, max_kv] the key positions each request has.
        """
        num_reqs, max_kv = kv_valid.shape
        slots = meta.kv_indices.view(num_reqs, max_kv)
        unique_slots, inverse = torch.unique(slots[kv_valid], return_inverse=True)
        if len(unique_slots) > (1.0 - self.shared_kv_min_dup) * int(kv_valid.sum()):
            return
        column = torch.full_like(slots, -1)  # request's key position -> unique slot column
        column[kv_valid] = inverse
        tokens, positions = token_visible.nonzero(as_tuple=True)
        mask = torch.zeros(len(token_req), len(unique_slots), dtype=torch.bool, device=self.device)
        mask[tokens, column[token_req[tokens], positions]] = True
        meta.shared_slots, meta.shared_mask = unique_slots, mask[None, None]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata
        assert batch.out_loc is not None
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        num_reqs, (_, num_heads, head_dim) = len(batch.reqs), q.shape
        if meta.extend_lens is not None:
            return self._per_request_attention(q, k, v, layer_id, meta)
        if meta.shared_slots is not None:
            return self._shared_attention(q, meta, layer_id)
        # [B, kv_heads, max_kv, dim]; index_select is ~5x faster than advanced indexing here.
        padded_shape = (num_reqs, -1, *k.shape[1:])
        keys = self.kv_cache.k_cache(layer_id).index_select(0, meta.kv_indices)
        values = self.kv_cache.v_cache(layer_id).index_select(0, meta.kv_indices)
        keys = keys.view(padded_shape).transpose(1, 2)
        values = values.view(padded_shape).transpose(1, 2)
        if meta.q_rows is None:
            q_padded = q.unsqueeze(2)  # one query per request: [B, heads, 1, dim]
        else:
            q_padded = q.new_zeros(num_reqs * meta.max_q, num_heads, head_dim)
            q_padded[meta.q_rows] = q
            q_padded = q_padded.view(num_reqs, meta.max_q, num_heads, head_dim).transpose(1, 2)
        mask = meta.masks[self.sliding_windows[layer_id]]
        out = F.scaled_dot_product_attention(
            q_padded, keys, values, attn_mask=mask, enable_gqa=True
        )
        if meta.q_rows is None:
            return out.squeeze(2)
        out = out.transpose(1, 2).reshape(num_reqs * meta.max_q, num_heads, head_dim)
        return out[meta.q_rows]

    def _per_request_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: TorchAttnMetadata,
    ) -> torch.Tensor:
        """SDPA request by request: no padding, and requests with nothing cached attend to their
        new q/k/v as they are with `is_causal` (SDPA's causal path skips the masked half), all
        in one call when they are also of one length."""
        assert meta.extend_lens is not None and meta.prefix_kv is not None
        lens = meta.extend_lens
        if all(kv is None for kv in meta.prefix_kv) and len(set(lens)) == 1:
            shape = (len(lens), lens[0])

            def heads_first(x: torch.Tensor) -> torch.Tensor:
                return x.view(*shape, *x.shape[1:]).transpose(1, 2)

            out = F.scaled_dot_product_attention(
                heads_first(q), heads_first(k), heads_first(v), is_causal=True, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(q.shape)
        outs, start = [], 0
        for extend_len, prefix in zip(lens, meta.prefix_kv):
            tokens = slice(start, start + extend_len)
            start += extend_len
            query = q[tokens].transpose(0, 1).unsqueeze(0)
            mask = None
            if prefix is None:
                keys, values = k[tokens], v[tokens]
            else:
                slots, mask = prefix
                keys = self.kv_cache.k_cache(layer_id).index_select(0, slots)
                values = self.kv_cache.v_cache(layer_id).index_select(0, slots)
            keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def _shared_attention(
        self, q: torch.Tensor, meta: TorchAttnMetadata, layer_id: int
    ) -> torch.Tensor:
        assert meta.shared_slots is not None
        # [1, kv_heads, slots, dim]: every distinct slot once, shared by all queries.
        keys = self.kv_cache.k_cache(layer_id).index_select(0, meta.shared_slots)
        values = self.kv_cache.v_cache(layer_id).index_select(0, meta.shared_slots)
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.shared_mask, enable_gqa=True
        )
        return out[0].transpose(0, 1)
