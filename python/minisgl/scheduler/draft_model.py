"""Drafting with a small model of the target's vocabulary (SGLang's STANDALONE speculative
algorithm): a second Engine in the scheduler's process decodes each request's next tokens
greedily, all of a step's requests batched; the target verifies them as it does n-gram drafts.

The draft keeps a KV pool, page table and radix prefix cache of its own, a request on its target
row: KV for positions [0, kv_len) of the request's tokens, starting from the longest prefix its
cache holds (a request gives its draft KV to that cache when it ends). A step first catches every
drafting request's draft KV up to its last token (one forward, whose logits at each request's last
position give its first draft), then runs one decode forward per further draft. The drafts fed
back are checked at the next step: the draft's KV at a position stays only where the token fed
there was kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.engine import Engine
from minisgl.kvcache import BaseCacheHandle, create_prefix_cache
from minisgl.utils import div_ceil

from .cache import CacheManager
from .prepare import prepare_forward_input

# Drafts are the draft model's argmax: the target keeps a draft only where it equals the token
# it samples there, which is exact for sampled requests too (a point-mass proposal).
ARGMAX = SamplingParams(temperature=0.0, max_tokens=None)
# A catch-up in which every request is this close to its last token (its tokens since the last
# verify step) runs as a decode forward with several query positions a request, as a verify step
# does (the fused C decode layer): as a prefill forward it cost the default model 34 ms against a
# decode step's 12 on Zen 2 (two requests, two tokens each).
DECODE_CATCH_UP = 16


@dataclass
class DraftSeq:
    """One request's draft KV: its row, its prefix-cache hit (locked while it runs), the
    positions with KV slots [0, slots_len) and with KV computed [0, kv_len), whose last
    len(fed) were fed draft tokens (valid where kept)."""

    row: int
    hit: BaseCacheHandle
    slots_len: int = 0
    kv_len: int = 0
    fed: list[int] = field(default_factory=list)


@dataclass
class _Planned:
    """A request's part in one proposal: the tokens its catch-up computes, its drafts (0: the
    catch-up stops short of its last token) and the positions that then need KV slots."""

    index: int
    req: Req
    seq: DraftSeq
    take: int
    steps: int
    slots_len: int


class DraftModelProposer:
    """Greedy drafts of a draft model for a step's decode requests, batched: one catch-up
    forward, then a decode forward per further draft token."""

    def __init__(
        self, engine: Engine, target_ctx: Context, max_catch_up: int, target_vocab: int
    ) -> None:
        """max_catch_up: the most tokens one catch-up forward computes (the prefill budget);
        target_vocab: the target's vocab_size (the draft's may be padded to another)."""
        self.engine = engine
        self.config = engine.config  # (kept after close)
        self.vocab = engine.model_config.vocab_size
        self.target_vocab = target_vocab
        self.pool = CacheManager(
            engine.num_pages,
            engine.page_size,
            engine.page_table,
            create_prefix_cache("radix", engine.device),
        )
        self.max_catch_up = max_catch_up
        self._target_ctx = target_ctx
        self._seqs: dict[Req, DraftSeq] = {}
        # The last proposal's forwards: (requests, seconds) of those shaped as a draft step
        # (decode forwards, a short catch-up), (tokens, seconds) of a prefill catch-up.
        self.step_seconds: list[tuple[int, float]] = []
        self.prefill_seconds: tuple[int, float] | None = None
        self.hit_tokens = 0  # tokens requests found in the draft's prefix cache, all told

    def propose(self, reqs: list[Req], counts: list[int]) -> list[list[int]]:
        """Up to counts[i] drafts for reqs[i], each caught up to its last token (device_len =
        len(input_ids) - 1); fewer where the draft's context ends, none where its pool is
        short or its catch-up needs more than this step's budget."""
        drafts: list[list[int]] = [[] for _ in reqs]
        plans = self._plan(reqs, counts)
        self.step_seconds, self.prefill_seconds = [], None
        if not plans:
            return drafts
        self.pool.allocate(
            [self._shadow(p.req, p.seq.row, 0, p.seq.slots_len) for p in plans],
            [p.slots_len for p in plans],
        )
        for p in plans:
            p.seq.slots_len = p.slots_len
        try:
            self._catch_up(plans)
            for step in range(1, max(p.steps for p in plans)):
                active = [p for p in plans if p.steps > step]
                shadows = [
                    self._shadow(p.req, p.seq.row, len(p.req.input_ids) + step - 1) for p in active
                ]
                started = time.perf_counter()
                self._forward(Batch(shadows, "decode"))
                self.step_seconds.append((len(active), time.perf_counter() - started))
        finally:
            set_global_ctx(self._target_ctx)
        for p, tokens in self._read_drafts(plans):
            # A draft past the target's rows (the draft's padding) ends the draft.
            drafts[p.index] = next(
                (tokens[:i] for i, t in enumerate(tokens) if t >= self.target_vocab), tokens
            )
            p.seq.kv_len = len(p.req.input_ids) + p.steps - 1
            p.seq.fed = tokens[:-1]
        return drafts

    def release(self, req: Req) -> None:
        """`req` finished, aborted or was retracted: its computed draft KV goes to the draft's
        prefix cache (a later request sharing its tokens, or it when it resumes, starts from
        there), the rest of its pages back to the free list."""
        seq = self._seqs.pop(req, None)
        if seq is None:
            return
        self._cut(req, seq)
        shadow = self._shadow(req, seq.row, seq.hit.cached_len, seq.slots_len)
        shadow.cache_handle = seq.hit
        self.pool.rewind(shadow, seq.kv_len)  # the slots of drafts past the computed KV
        self.pool.cache_req(shadow, finished=True)

    def lag(self, req: Req) -> int:
        """Tokens of `req` its draft KV lacks (at most): a catch-up's size before it drafts.
        A request without draft KV gets it here, from its prefix-cache hit (held until
        release)."""
        seq = self._seq(req)
        return max(0, len(req.input_ids) - (seq.kv_len - len(seq.fed)))

    def check_integrity(self) -> None:
        """With no request running: every draft page free."""
        assert not self._seqs, f"draft KV of {len(self._seqs)} released requests kept"
        self.pool.check_integrity()

    def close(self) -> None:
        """Let go of the draft engine's memory; unusable afterwards."""
        del self.engine

    def _seq(self, req: Req) -> DraftSeq:
        """The request's draft KV; a new one starts from the prefix cache's longest hit (its
        pages locked, its page-table row pointed at them)."""
        seq = self._seqs.get(req)
        if seq is None:
            shadow = self._shadow(req, req.table_idx, 0, 0)
            hit = self.pool.match_req(shadow)
            self.pool.lock(hit)
            self.pool.attach(shadow, hit)
            seq = DraftSeq(req.table_idx, hit, hit.cached_len, hit.cached_len)
            self.hit_tokens += hit.cached_len
            self._seqs[req] = seq
        assert seq.row == req.table_idx, f"{req} moved rows without releasing its draft KV"
        return seq

    def _sync(self, req: Req) -> DraftSeq:
        """The request's draft KV, cut to the positions whose fed token was kept; its last token
        is always computed again, for the logits of the first draft."""
        seq = self._seq(req)
        self._cut(req, seq)
        seq.kv_len = min(seq.kv_len, len(req.input_ids) - 1)
        return seq

    @staticmethod
    def _cut(req: Req, seq: DraftSeq) -> None:
        """Forget the KV of fed draft tokens that the request did not keep."""
        if seq.fed:
            start = seq.kv_len - len(seq.fed)
            kept = req.input_ids[start : start + len(seq.fed)].tolist()
            same = 0
            while same < len(kept) and kept[same] == seq.fed[same]:
                same += 1
            seq.kv_len, seq.fed = start + same, []

    def _plan(self, reqs: list[Req], counts: list[int]) -> list[_Planned]:
        """Who drafts how much: the catch-up within its token budget, pages from the free ones
        and the prefix cache's evictable ones (a request they do not fit skips this step)."""
        plans: list[_Planned] = []
        page = self.engine.page_size
        budget, free = self.max_catch_up, self.pool.available_size // page
        for i, (req, count) in enumerate(zip(reqs, counts)):
            length = len(req.input_ids)
            # The last draft's token is written at length + count - 1, inside the draft's row.
            count = min(count, self.engine.max_model_len - length)
            if count <= 0 or budget <= 0:
                continue
            seq = self._sync(req)
            take = min(length - seq.kv_len, budget)
            if self.vocab < self.target_vocab and take > 0:
                # A token the draft has no row for (the target's padding): no drafts then.
                if int(req.input_ids[seq.kv_len : seq.kv_len + take].max()) >= self.vocab:
                    continue
            steps = count if seq.kv_len + take == length else 0
            end = max(seq.slots_len, length + steps - 1 if steps else seq.kv_len + take)
            grow = div_ceil(end, page) - div_ceil(seq.slots_len, page)
            if grow > free:
                continue
            free, budget = free - grow, budget - take
            plans.append(_Planned(i, req, seq, take, steps, end))
        return plans

    def _catch_up(self, plans: list[_Planned]) -> None:
        """One forward over each request's tokens not yet in its draft KV; a request caught up to
        its last token samples its first draft there."""
        device = self.engine.device
        rows = torch.tensor([p.seq.row for p in plans], dtype=torch.int64)
        takes = torch.tensor([p.take for p in plans], dtype=torch.int64)
        cols = torch.cat([torch.arange(p.seq.kv_len, p.seq.kv_len + p.take) for p in plans])
        ids = torch.cat([p.req.input_ids[p.seq.kv_len : p.seq.kv_len + p.take] for p in plans])
        pool_rows = rows.repeat_interleave(takes).to(device)
        self.engine.token_pool[pool_rows, cols.to(device)] = ids.to(device, torch.int32)
        shadows = [
            self._shadow(p.req, p.seq.row, p.seq.kv_len, p.seq.kv_len + p.take) for p in plans
        ]
        started = time.perf_counter()
        if all(p.steps > 0 and 0 < p.take <= DECODE_CATCH_UP for p in plans):
            # The verify form: every position's KV, logits at each request's last one only.
            batch = Batch(shadows, "decode", drafts=[[0] * (p.take - 1) for p in plans])
            forward = prepare_forward_input(batch, self.engine)
            batch.logits_indices = (takes.cumsum(0) - 1).to(device)
            self.engine.forward(forward)
            self.step_seconds.append((len(plans), time.perf_counter() - started))
        else:
            self._forward(Batch(shadows, "prefill"))
            self.prefill_seconds = (int(takes.sum()), time.perf_counter() - started)
        for p in plans:
            p.seq.kv_len += p.take

    def _read_drafts(self, plans: list[_Planned]) -> list[tuple[_Planned, list[int]]]:
        """Each drafting request's tokens, from the draft's token pool (one copy to the CPU)."""
        drafting = [p for p in plans if p.steps > 0]
        if not drafting:
            return []
        device = self.engine.device
        rows = torch.tensor([p.seq.row for p in drafting], dtype=torch.int64)
        steps = torch.tensor([p.steps for p in drafting], dtype=torch.int64)
        starts = [len(p.req.input_ids) for p in drafting]
        cols = torch.cat([torch.arange(s, s + p.steps) for s, p in zip(starts, drafting)])
        tokens = self.engine.token_pool[rows.repeat_interleave(steps).to(device), cols.to(device)]
        flat = tokens.tolist()
        out: list[tuple[_Planned, list[int]]] = []
        start = 0
        for p in drafting:
            out.append((p, flat[start : start + p.steps]))
            start += p.steps
        return out

    def _forward(self, batch: Batch) -> None:
        # The sampled token lands in the draft's token pool, where the next step reads its input.
        self.engine.forward(prepare_forward_input(batch, self.engine))

    @staticmethod
    def _shadow(req: Req, row: int, cached_len: int, device_len: int | None = None) -> Req:
        """The draft side of `req`: its tokens, the draft's row and lengths, argmax sampling."""
        return Req(
            req.uid,
            req.input_ids,
            ARGMAX,
            prompt_len=len(req.input_ids),
            max_device_len=req.max_device_len,
            table_idx=row,
            cached_len=cached_len,
            device_len=cached_len + 1 if device_len is None else device_len,
        )
