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
request's measured acceptance (spec_choice.py), so speculation turns itself down where rows are
dear (large batches, long contexts), drafting is dear or guesses poor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from minisgl.core import Req

from .config import SchedulerConfig
from .draft_model import DECODE_CATCH_UP, DraftModelProposer
from .ngram import NgramCache, NgramIndex
from .spec_choice import bank_slack, best_drafts, best_drafts_by_depth, geometric
from .spec_cost import MatchStats, Rate, StepCost
from .verify import within_grammar

# A new request's chance that a draft token is accepted given the one before was, and how fast
# its measured rate replaces that (per verified step).
PRIOR_ACCEPTANCE = 0.5
# N-gram drafts are judged by the length of the match that proposed them, up to this: it tells
# most of whether they hold (the default model's greedy outputs on benchmark/speculative.py's
# prompts, Zen 3: a first draft kept 18% of the time after a 1-token match, 46% after 2 tokens,
# 89% after 4 or more; a request's own average mixed them, and its drafts lost on AVX2).
MATCH_LENGTHS = 4
ACCEPTANCE_WEIGHT = 0.3
# Per step without drafts, an estimate moves this much back toward the prior: a request whose
# guesses were poor is tried again now and then (its text may turn repetitive).
RECOVERY = 0.02
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
    match: tuple[bool, int] | None = None  # its n-gram drafts' match (MatchStats.key)
    acceptance: float = PRIOR_ACCEPTANCE
    # Seconds it may lose to other requests' drafts and keep its pace (spec_choice.bank_slack).
    slack: float = 0.0
    verify_steps: int = 0
    accepted_tokens: int = 0


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
        row_bounds: Sequence[int] = (),
    ) -> None:
        self.max_drafts = num_draft_tokens - 1
        if drafter is not None and num_steps is not None:
            self.max_drafts = min(self.max_drafts, num_steps)
        self.min_match, self.max_match = min_match, max_match
        # Row counts past which the target computes a row another way (decode_row_bounds): a
        # verify step stays within its batch's, so its rows are what decoding one by one gives
        # (and the kernel's cost does not jump: AVX2's tiles past 64 rows).
        self.row_bounds = sorted(row_bounds)
        self.cache = NgramCache(min_match, max_match, branch_length, capacity)
        self.matches = MatchStats(max(self.max_drafts, 1), MATCH_LENGTHS, PRIOR_ACCEPTANCE)
        self.drafter = drafter
        self.cost = StepCost()
        # A draft-model step's seconds (a run's over its deepest draft) against the requests
        # it drafted for.
        self.draft_cost = StepCost()
        # A draft catch-up's seconds per token of a request's prompt (a prefill of the draft).
        self.catch_up_seconds = Rate()
        self.stats = SpecStats()
        self._states: WeakKeyDictionary[Req, DraftState] = WeakKeyDictionary()

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        drafter: DraftModelProposer | None = None,
        row_bounds: Sequence[int] = (),
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
            row_bounds,
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
            slack = [self.state(req).slack for req in reqs]
            drafts = self._worth_it(
                [(d, k) for d, (_, k) in zip(drafts, guesses)], len(reqs), slack
            )
        else:
            # (a constrained request's drafts are cut after the draft model ran: it drafts free)
            drafts = within_grammar(reqs, self._model_drafts(reqs, limits))
        for req, draft in zip(reqs, drafts):
            if not draft:
                self.skipped(req)
        return drafts

    def _ngram_guess(self, req: Req, limit: int) -> tuple[list[int], list[float]]:
        """A request's n-gram draft and each depth's chance to be kept (by its match)."""
        if limit <= 0:
            return [], []
        state = self.state(req)
        if state.index is None:
            state.index = NgramIndex(self.min_match, self.max_match)
        known = len(state.index.tokens)
        state.index.extend(req.input_ids[known:].tolist())
        draft, length = state.index.propose(limit)
        shared = not draft
        if shared:
            draft, length = self.cache.propose(state.index.tokens[-self.max_match :], limit)
        state.match = self.matches.key(shared, length) if draft else None
        return draft, self.matches.survival(state.match)[: len(draft)] if draft else []

    def _model_drafts(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """The draft model, run for as many tokens of each request as the cost model says pay
        (placeholders stand for the tokens it is not yet run for); not run where none do."""
        assert self.drafter is not None
        slots = [
            ([0] * limit, geometric(self.state(req).acceptance, limit))
            for req, limit in zip(reqs, limits)
        ]
        slack = [self.state(req).slack for req in reqs]
        counts = [len(draft) for draft in self._worth_it(slots, len(reqs), slack)]
        counts = [
            0 if count and self._catch_up_loses(req, count, len(reqs)) else count
            for req, count in zip(reqs, counts)
        ]
        if not any(counts):
            self.draft_cost.fade()  # not run: in a while, tried again
            return [[] for _ in reqs]
        drafts = self.drafter.propose(reqs, counts)
        # Each draft step (a short catch-up, a decode forward) against the requests it ran.
        for requests, seconds in self.drafter.step_seconds:
            self.draft_cost.observe(requests, seconds)
        if self.drafter.prefill_seconds is not None:
            tokens, seconds = self.drafter.prefill_seconds
            self.catch_up_seconds.observe(tokens, seconds)
        return drafts

    def _catch_up_loses(self, req: Req, drafts: int, rows: int) -> bool:
        """Whether catching `req`'s draft KV up (a new request's prompt past the draft's prefix
        cache hit) before its `drafts` drafts would cost more than drafting can save over
        the tokens it has left: at most its share of a step of `rows` per token, less the
        share that verify steps of the expected length (its acceptance) still take."""
        assert self.drafter is not None
        lag = self.drafter.lag(req)
        if lag <= DECODE_CATCH_UP or not self.catch_up_seconds.measured:
            return False
        c0, c1 = self.cost.coefficients()
        acceptance = self.state(req).acceptance
        expected = sum(acceptance**j for j in range(drafts + 1))
        saved = (c0 + c1 * rows) / rows * (1.0 - 1.0 / expected)
        left = req.max_device_len - len(req.input_ids)
        return self.catch_up_seconds.per_unit() * lag > saved * left

    def _room(self, rows: int) -> int:
        """Draft rows a step of `rows` requests may add without crossing a row bound."""
        bound = next((b for b in self.row_bounds if b >= rows), None)
        return 1 << 30 if bound is None else bound - rows

    def _draft_coefficients(self) -> tuple[float, float]:
        """(d0, d1): a draft-model step's seconds as d0 + d1 * requests; none without one."""
        if self.drafter is None:
            return 0.0, 0.0
        if self.cost.measured and self.draft_cost.measured:
            return self.draft_cost.coefficients()
        c0, c1 = self.cost.coefficients()
        return PRIOR_DRAFT_COST * c0, PRIOR_DRAFT_COST * c1

    def _worth_it(
        self,
        guesses: list[tuple[list[int], list[float]]],
        rows: int,
        slack: Sequence[float] | None = None,
    ) -> list[list[int]]:
        """The drafts that pay (spec_choice): by expected tokens per second, each request
        keeping its pace once its `slack` seconds (none where not given) are spent."""
        if self.drafter is None:
            return best_drafts(guesses, rows, self.cost, self._room(rows), slack)
        return best_drafts_by_depth(
            guesses,
            rows,
            self.cost.coefficients(),
            self._draft_coefficients(),
            self._room(rows),
            slack,
        )

    def settle(self, reqs: Sequence[Req], emitted: Sequence[int], rows: int) -> None:
        """After a decode step of `rows` query rows: each unfinished request banks its
        `emitted` tokens against the step's seconds (spec_choice.bank_slack, the cost model's
        seconds, as the drafts were chosen)."""
        line = self.cost.coefficients()
        plain = self.cost.seconds(len(reqs), line)
        seconds = plain if rows <= len(reqs) else self.cost.seconds(rows, line)
        for req, count in zip(reqs, emitted):
            state = self._states.get(req)
            if state is not None and req.finish_reason is None:
                state.slack = bank_slack(state.slack, count, plain, seconds)

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
        if state.match is not None:  # (an n-gram draft's)
            self.matches.observe(state.match, drafted, accepted)
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
