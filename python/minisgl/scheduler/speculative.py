"""Speculative decoding: which draft tokens each decode request verifies in a step, and what a
verified step leaves.

A request with drafts d1..dk runs k + 1 query positions in one decode step (its last token and
the drafts, attention causal over them); row i is sampled as if decoded one by one (penalties,
min_tokens and logit_bias see d1..di), and the output is the longest run of drafts equal to
the sampled tokens plus the next sampled token. Drafts are fixed guesses, so this is exact
rejection sampling (a draft is kept with its probability under the target), greedy or not.

Drafts come from n-grams (ngram.py: NGRAM) or a draft model (draft_model.py: STANDALONE).
Whether a draft token is worth its row is a cost model (`StepCost`: a step's seconds against
its query rows, fitted as it runs; with a draft model, its steps' seconds too) against each
request's measured acceptance, so speculation turns itself down where rows are dear (large
batches, long contexts), drafting is dear or guesses poor.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from minisgl.core import Req

from .config import SchedulerConfig
from .draft_model import DraftModelProposer
from .grammar import allowed_prefix
from .ngram import NgramCache, NgramIndex

# A new request's chance that a draft token is accepted given the one before was, and how fast
# its measured rate replaces that (per verified step).
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.3
# Per step without drafts, an estimate moves this much back toward the prior: a request whose
# guesses were poor is tried again now and then (its text may turn repetitive).
RECOVERY = 0.02
# The cost of one more query row relative to a one-row step, before any step was measured.
PRIOR_ROW_COST = 0.03
# A draft-model step's cost relative to a target step, until both were measured: optimistic, so
# that drafts get tried and measured.
PRIOR_DRAFT_COST = 0.1


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
    """One request's drafting: its n-gram index (NGRAM), acceptance estimate and counters."""

    index: NgramIndex | None = None
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

    @property
    def measured(self) -> bool:
        return bool(self._buckets)

    def observe(self, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows <= 0:
            return
        self.fade()
        bucket = self._buckets.setdefault(rows, [0.0, 0.0])
        bucket[0] += seconds
        bucket[1] += 1.0

    def fade(self) -> None:
        """Older measurements weigh less; row counts not seen for long weigh nothing and are
        dropped (all of them: the prior is back, and what was measured dear is tried again)."""
        for bucket in self._buckets.values():
            bucket[0] *= self.decay
            bucket[1] *= self.decay
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
    """Drafts for a decode step (n-gram lookup or a draft model), sized by the cost model, and
    what verification teaches it. `num_draft_tokens` counts a request's verified positions, its
    last token included (SGLang's --speculative-num-draft-tokens); a draft model drafts at most
    `num_steps` of them (--speculative-num-steps)."""

    def __init__(
        self,
        num_draft_tokens: int,
        min_match: int,
        max_match: int,
        branch_length: int,
        capacity: int,
        drafter: DraftModelProposer | None = None,
        num_steps: int | None = None,
    ) -> None:
        self.max_drafts = num_draft_tokens - 1
        if drafter is not None and num_steps is not None:
            self.max_drafts = min(self.max_drafts, num_steps)
        self.min_match, self.max_match = min_match, max_match
        self.cache = NgramCache(min_match, max_match, branch_length, capacity)
        self.drafter = drafter
        self.cost = StepCost()
        # A draft-model step's seconds (a run's over its deepest draft) against the requests
        # it drafted for.
        self.draft_cost = StepCost()
        self.stats = SpecStats()
        self._states: WeakKeyDictionary[Req, DraftState] = WeakKeyDictionary()

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, drafter: DraftModelProposer | None = None
    ) -> Speculator:
        assert config.speculative_num_draft_tokens is not None
        return cls(
            config.speculative_num_draft_tokens,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
            config.speculative_ngram_branch_length,
            config.speculative_ngram_capacity,
            drafter,
            config.speculative_num_steps,
        )

    def state(self, req: Req) -> DraftState:
        state = self._states.get(req)
        if state is None:
            state = self._states[req] = DraftState()
        return state

    def propose(self, reqs: list[Req], room: list[int]) -> list[list[int]]:
        """Each request's drafts (at most room[i]), only as many as the cost model says pay."""
        # Drafts follow the last known token: a request must be caught up (no overlap).
        limits = [
            0 if req.device_len != len(req.input_ids) - 1 else max(0, min(limit, self.max_drafts))
            for req, limit in zip(reqs, room)
        ]
        if self.drafter is None:
            guesses = [self._ngram_guess(req, limit) for req, limit in zip(reqs, limits)]
            drafts = within_grammar(reqs, [draft for draft, _ in guesses])
            drafts = self._worth_it([(d, a) for d, (_, a) in zip(drafts, guesses)], len(reqs))
        else:
            # (a constrained request's drafts are cut after the draft model ran: it drafts free)
            drafts = within_grammar(reqs, self._model_drafts(reqs, limits))
        for req, draft in zip(reqs, drafts):
            if not draft:
                self.skipped(req)
        return drafts

    def _ngram_guess(self, req: Req, limit: int) -> tuple[list[int], float]:
        if limit <= 0:
            return [], 0.0
        state = self.state(req)
        if state.index is None:
            state.index = NgramIndex(self.min_match, self.max_match)
        known = len(state.index.tokens)
        state.index.extend(req.input_ids[known:].tolist())
        draft, _ = state.index.propose(limit)
        if not draft:
            draft, _ = self.cache.propose(state.index.tokens[-self.max_match :], limit)
        return draft, state.acceptance

    def _model_drafts(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """The draft model, run for as many tokens of each request as the cost model says pay
        (placeholders stand for the tokens it is not yet run for); not run where none do."""
        assert self.drafter is not None
        slots = [
            ([0] * limit, self.state(req).acceptance if limit > 0 else 0.0)
            for req, limit in zip(reqs, limits)
        ]
        counts = [len(draft) for draft in self._worth_it(slots, len(reqs))]
        if not any(counts):
            self.draft_cost.fade()  # not run: in a while, tried again
            return [[] for _ in reqs]
        started = time.perf_counter()
        drafts = self.drafter.propose(reqs, counts)
        levels = max(len(draft) for draft in drafts)
        drafted = sum(1 for draft in drafts if draft)
        # A run that caught up on whole prompts (requests' first drafts) is not what the next
        # ones cost (a request catches up on 1 or 2 tokens per verify step).
        if levels and self.drafter.caught_up <= (self.max_drafts + 1) * drafted:
            self.draft_cost.observe(drafted, (time.perf_counter() - started) / levels)
        return drafts

    def _draft_coefficients(self) -> tuple[float, float]:
        """(d0, d1): a draft-model step's seconds as d0 + d1 * requests; none without one."""
        if self.drafter is None:
            return 0.0, 0.0
        if self.cost.measured and self.draft_cost.measured:
            return self.draft_cost.coefficients()
        c0, c1 = self.cost.coefficients()
        return PRIOR_DRAFT_COST * c0, PRIOR_DRAFT_COST * c1

    def _worth_it(self, guesses: list[tuple[list[int], float]], rows: int) -> list[list[int]]:
        """Cut the drafts to the tokens that raise expected tokens per second: the j-th draft of
        a request is accepted with probability a^j; its row costs c1 against a step's c0 + c1 *
        rows (plus, from a draft model, d1, and d0 for the first request that drafts j), so it
        pays while a^j * seconds > its cost * expected tokens."""
        c0, c1 = self.cost.coefficients()
        d0, d1 = self._draft_coefficients()
        candidates = [
            (acceptance**j, i, j)
            for i, (draft, acceptance) in enumerate(guesses)
            for j in range(1, len(draft) + 1)
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        taken = [0] * len(guesses)
        expected, seconds, depth = float(rows), c0 + c1 * rows, 0
        for gain, i, j in candidates:
            cost = c1 + d1 + (d0 if j > depth else 0.0)
            if taken[i] != j - 1 or gain * seconds <= cost * expected:
                continue  # a cheaper candidate (a draft step already paid for) may still pay
            taken[i] = j
            expected += gain
            seconds += cost
            depth = max(depth, j)
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

    def release(self, req: Req) -> None:
        """`req` gave back its pages (finished, aborted or retracted): its draft KV goes too;
        finished, what it taught is kept."""
        if self.drafter is not None:
            self.drafter.release(req)
        if req.finish_reason is not None:  # (not a retraction: the request comes back)
            self.learn(req)

    def learn(self, req: Req) -> None:
        """A finished request's output feeds the shared n-gram cache (its prompt is in the index
        of every request that has it: a later request's own lookup finds it there)."""
        if self.drafter is None:
            start = max(0, req.prompt_len - self.max_match)
            self.cache.insert(req.input_ids[start:].tolist())
        self._states.pop(req, None)

    def check_integrity(self) -> None:
        """With no request running: the draft model's pages all free."""
        if self.drafter is not None:
            self.drafter.check_integrity()

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()


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


def within_grammar(reqs: list[Req], drafts: list[list[int]]) -> list[list[int]]:
    """Each constrained request's drafts cut to the run its grammar takes."""
    return [
        draft if req.grammar is None else draft[: allowed_prefix(req.grammar, draft)]
        for req, draft in zip(reqs, drafts)
    ]


def verify_prefixes(drafts: list[list[int]]) -> list[list[int]]:
    """For each row of `verify_rows(reqs, drafts)`, the drafts before its position: a
    constrained row's token mask is its grammar's after them."""
    return [draft[:i] for draft in drafts for i in range(len(draft) + 1)]
