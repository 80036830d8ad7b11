"""The memory model: how many KV pages admitted requests are expected to claim.

Admission, chunked prefill and decode all count pages by `PageBudget.pages_to_claim`, and
request validation guarantees that a request alone always fits (its whole length is within
`max_model_len`, which the pool bounds), so an optimistic estimate can only cost a
retraction, never an allocation that fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from minisgl.core import Req
from minisgl.utils import div_ceil

# The share of each admitted request's remaining output that is reserved (SGLang's
# new_token_ratio): it starts cautious, decays while decode runs fine, and jumps after a
# retraction. Retraction is what keeps an optimistic estimate safe.
RATIO_INIT, RATIO_MIN, RATIO_DECAY, RATIO_AFTER_RETRACTION = 0.7, 0.1, 0.001, 0.2
# Output tokens a request is expected to produce at most, whatever its max_tokens (SGLang's
# clip_max_new_tokens_estimation): one request that may run to the end of a long context must
# not reserve the whole pool and keep everyone else waiting.
OUTPUT_ESTIMATE_CLIP = 4096


class PageBudget:
    """Expected page claims of requests, at the current `new_token_ratio`."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.new_token_ratio = RATIO_INIT

    def pages_to_claim(self, req: Req, held_len: int) -> int:
        """Pages `req` is expected to claim beyond those for its first `held_len` positions: all
        of its known tokens, and a `new_token_ratio` share of its output (clipped)."""
        known = max(len(req.input_ids), req.device_len)
        remaining_out = min(req.max_device_len - known, OUTPUT_ESTIMATE_CLIP)
        expected = min(req.max_device_len, known + math.ceil(remaining_out * self.new_token_ratio))
        return max(0, div_ceil(expected, self.page_size) - div_ceil(held_len, self.page_size))

    def reserved(self, admitted: Iterable[Req]) -> int:
        """Pages admitted requests (running or chunked) are expected to claim before finishing."""
        return sum(self.pages_to_claim(r, r.device_len) for r in admitted)

    def on_decode(self) -> None:
        self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)

    def on_retraction(self) -> None:
        self.new_token_ratio = min(1.0, self.new_token_ratio + RATIO_AFTER_RETRACTION)
