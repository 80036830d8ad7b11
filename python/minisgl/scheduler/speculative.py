"""Speculative decoding: which draft tokens each decode request verifies in a step, and what a
verified step leaves.

A request with drafts d1..dk runs k + 1 query positions in one decode step (its last token and
the drafts, attention causal over them); row i is sampled as if decoded one by one (penalties,
min_tokens and logit_bias see d1..di), and the output is the longest run of drafts equal to
the sampled tokens plus the next sampled token. Drafts are fixed guesses, so this is exact
rejection sampling (a draft is kept with its probability under the target), greedy or not.

Whether a draft token is worth its row is a cost model (`StepCost`: a step's seconds against
its query rows, fitted as it runs) against each request's measured acceptance, so speculation
turns itself down where rows are dear (large batches, long contexts) or guesses poor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from minisgl.core import Req

from .ngram import NgramCache, NgramIndex

ALGORITHMS = ("NGRAM",)
# A new request's chance that a draft token is accepted given the one before was, and how fast
# its measured rate replaces that (per verified step).
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.3
# Per step without drafts, an estimate moves this much back toward the prior: a request whose
# guesses were poor is tried again now and then (its text may turn repetitive).
RECOVERY = 0.02
# The cost of one more query row relative to a one-row step, before any step was measured.
PRIOR_ROW_COST = 0.03


@dataclass
class SpecStats:
    """Lifetime counters (/metrics): verify steps, draft tokens verified and accepted."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_accepted(self) -> float:
        """Tokens a request gets per verify step: accepted drafts plus the one sampled."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


@dataclass
class DraftState:
    """One request's drafting: its n-gram index, acceptance estimate and counters."""

    index: NgramIndex
    acceptance: float = PRIOR_ACCEPTANCE
    verify_steps: int = 0
    accepted_tokens: int = 0


class StepCost:
    """A decode step's seconds as c0 + c1 * rows: a weighted least-squares line through the
    mean seconds of each row count seen (means and weights decay, so the line follows a
    context that grows). Until two row counts are seen, a row costs `row_cost` of the step:
    optimistic, so that drafts get tried and measured."""

    decay = 0.98

    def __init__(self, row_cost: float = PRIOR_ROW_COST) -> None:
        self.row_cost = row_cost
        self._buckets: dict[int, list[float]] = {}  # rows -> [weighted seconds, weight]

    def observe(self, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows <= 0:
            return
        for bucket in self._buckets.values():
            bucket[0] *= self.decay
            bucket[1] *= self.decay
        bucket = self._buckets.setdefault(rows, [0.0, 0.0])
        bucket[0] += seconds
        bucket[1] += 1.0
        # Row counts not seen for long weigh nothing: drop them.
        for stale in [r for r, (_, w) in self._buckets.items() if w < 1e-3]:
            del self._buckets[stale]

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) in seconds; (1, row_cost) before any step was measured."""
        points = [(rows, total / weight, weight) for rows, (total, weight) in self._buckets.items()]
        if not points:
            return 1.0, self.row_cost
        if len(points) == 1:
            rows, seconds, _ = points[0]
            c0 = seconds / (1.0 + self.row_cost * rows)
            return c0, self.row_cost * c0
        n = sum(w for _, _, w in points)
        mean_x = sum(w * x for x, _, w in points) / n
        mean_y = sum(w * y for _, y, w in points) / n
        var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        cov = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points)
        c1 = max(cov / var, 1e-3 * mean_y / mean_x)  # a row is never free
        c0 = max(mean_y - c1 * mean_x, 1e-3 * mean_y)
        return c0, c1


class Speculator:
    """Drafts for a decode step (n-gram lookup), sized by the cost model, and what verification
    teaches it. `num_draft_tokens` counts a request's verified positions, its last token
    included (SGLang's --speculative-num-draft-tokens)."""

    def __init__(
        self,
        num_draft_tokens: int,
        min_match: int,
        max_match: int,
        branch_length: int,
        capacity: int,
    ) -> None:
        self.max_drafts = num_draft_tokens - 1
        self.min_match, self.max_match = min_match, max_match
        self.cache = NgramCache(min_match, max_match, branch_length, capacity)
        self.cost = StepCost()
        self.stats = SpecStats()
        self._states: WeakKeyDictionary[Req, DraftState] = WeakKeyDictionary()

    def state(self, req: Req) -> DraftState:
        state = self._states.get(req)
        if state is None:
            state = self._states[req] = DraftState(NgramIndex(self.min_match, self.max_match))
        return state

    def propose(self, reqs: list[Req], room: list[int]) -> list[list[int]]:
        """Each request's drafts (at most room[i]), only as many as the cost model says pay."""
        guesses: list[tuple[list[int], float]] = []
        for req, limit in zip(reqs, room):
            limit = min(limit, self.max_drafts)
            # Drafts follow the last known token: a request must be caught up (no overlap).
            if limit <= 0 or req.grammar is not None or req.device_len != len(req.input_ids) - 1:
                guesses.append(([], 0.0))
                continue
            state = self.state(req)
            known = len(state.index.tokens)
            state.index.extend(req.input_ids[known:].tolist())
            draft, _ = state.index.propose(limit)
            if not draft:
                draft, _ = self.cache.propose(state.index.tokens[-self.max_match :], limit)
            guesses.append((draft, state.acceptance))
        drafts = self._worth_it(guesses, len(reqs))
        for req, draft in zip(reqs, drafts):
            if not draft:
                self.skipped(req)
        return drafts

    def _worth_it(self, guesses: list[tuple[list[int], float]], rows: int) -> list[list[int]]:
        """Cut the drafts to the tokens that raise expected tokens per second: the j-th draft of
        a request is accepted with probability a^j; a row costs c1 against a step's c0 + c1 *
        rows, so it pays while a^j * (c0 + c1 * rows) > c1 * expected tokens."""
        c0, c1 = self.cost.coefficients()
        candidates = [
            (acceptance**j, i)
            for i, (draft, acceptance) in enumerate(guesses)
            for j in range(1, len(draft) + 1)
        ]
        candidates.sort(reverse=True)
        taken = [0] * len(guesses)
        expected = float(rows)
        for gain, i in candidates:
            if gain * (c0 + c1 * rows) <= c1 * expected:
                break
            taken[i] += 1
            expected += gain
            rows += 1
        return [draft[:count] for (draft, _), count in zip(guesses, taken)]

    def skipped(self, req: Req) -> None:
        """A step in which `req` had no drafts: its estimate recovers toward the prior."""
        state = self._states.get(req)
        if state is not None:
            state.acceptance += RECOVERY * (PRIOR_ACCEPTANCE - state.acceptance)

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A verified step of `req`: `accepted` of its `drafted` tokens were kept."""
        state = self.state(req)
        # Drafts are tried in order until one fails: `accepted` successes in this many trials.
        trials = min(accepted + 1, drafted)
        state.acceptance += ACCEPTANCE_WEIGHT * (accepted / trials - state.acceptance)
        state.verify_steps += 1
        state.accepted_tokens += accepted
        self.stats.verify_steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted

    def learn(self, req: Req) -> None:
        """A finished request's output feeds the shared n-gram cache (its prompt is in the index
        of every request that has it: a later request's own lookup finds it there)."""
        start = max(0, req.prompt_len - self.max_match)
        self.cache.insert(req.input_ids[start:].tolist())
        self._states.pop(req, None)


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """How many drafts a verify step keeps: those up to the first that differs from the token
    sampled at the position before it (sampled[i] was drawn where draft[i] was guessed)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


def verify_rows(reqs: list[Req], drafts: list[list[int]]) -> list[Req]:
    """One sampled row per query position of a verify step: a request with k drafts gets k + 1,
    row i a copy that knows i more tokens (the drafts before it), as if decoded one by one."""
    rows: list[Req] = []
    for req, draft in zip(reqs, drafts):
        if not draft:
            rows.append(req)
            continue
        for i in range(len(draft) + 1):
            row = copy.copy(req)
            row.device_len = req.cached_len + 1 + i
            rows.append(row)
    return rows
