"""How many drafts a decode step verifies: the draft tokens that raise the batch's expected
tokens per second (the measured cost of a step against its rows, spec_cost.py), while every
request keeps its pace."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .spec_cost import StepCost

# A guess: draft tokens, and for j = 1..len the chance that its first j tokens are kept.
Guess = tuple[list[int], list[float]]

# The most a request's expected tokens per second may fall by other requests' draft rows in its
# step (their noise-level share): a batch's drafts pay only where every request in it keeps its
# pace. Maximizing the batch's tokens per second alone drafted for the requests whose guesses
# held and slowed the others, whose pace set the batch's end (the default model, batch 4, Zen
# 3: the same number of steps as without drafts, each dearer; 0.82-0.93x on edit and chat).
SLOWDOWN_ALLOWED = 0.03
# The pace is kept over a request's decode, not step by step: what its kept drafts saved, and
# its SLOWDOWN_ALLOWED share of each step, is banked as slack (up to this many plain steps) that
# later steps may spend on other requests' draft rows. Step by step, a batch drafted only where
# every request had a guess at once. The default model, a step's cost fixed to the line its run
# measured (Zen 4): batch 4 edit 1.33x -> 1.38x, document 1.18x -> 1.25x, rewrite 1.19x ->
# 1.22x, chat 1.01x -> 0.98x; batch 16 within 2%; 8 or 128 steps alike.
BANKED_STEPS = 8
# A draft model runs only where it is expected to raise tokens per second by this share:
# its costs come in lumps (a forward of the draft for a few tokens' gain), so a predicted gain of
# a few percent was as often a loss (Zen 2, the dense default with its GGUF draft at batch 4).
DRAFT_MARGIN = 0.1


def best_drafts(
    guesses: Sequence[Guess], rows: int, cost: StepCost, room: int, slack: Sequence[float] | None
) -> list[list[int]]:
    """N-gram guesses cut to the tokens that give the most expected tokens per second: drafts
    are taken best chance first (at most `room`), as many as maximize (rows + sum of their
    k_j) / seconds(rows + drafts), the step's time per row count measured (StepCost.seconds:
    lumpy costs, where one row more loses and four more win, are seen), while every request
    keeps its pace (keeps_pace, once its `slack` seconds are spent)."""
    line = cost.coefficients()
    candidates = sorted(
        (
            (chances[j - 1], i, j)
            for i, (draft, chances) in enumerate(guesses)
            for j in range(1, len(draft) + 1)
        ),
        key=lambda c: (-c[0], c[1], c[2]),
    )[:room]
    plain = cost.seconds(rows, line)
    best_rate, best_count = rows / plain, 0
    expected = float(rows)
    # Each request's expected kept drafts plus its slack in tokens of a plain step, and a heap
    # of them (stale entries skipped) whose least is the slowest request's gain.
    gains = slack_tokens(slack, len(guesses), plain)
    least = [(gain, i) for i, gain in enumerate(gains)]
    heapq.heapify(least)
    for count, (chance, i, _) in enumerate(candidates, 1):
        expected += chance
        gains[i] += chance
        heapq.heappush(least, (gains[i], i))
        while least[0][0] != gains[least[0][1]]:
            heapq.heappop(least)
        seconds = cost.seconds(rows + count, line)
        rate = expected / seconds
        if rate > best_rate and keeps_pace(least[0][0], seconds, plain):
            best_rate, best_count = rate, count
    # (chances fall with depth, so a request's j-th draft comes after its first j - 1)
    taken = [0] * len(guesses)
    for _, i, j in candidates[:best_count]:
        taken[i] = max(taken[i], j)
    return [draft[:count] for (draft, _), count in zip(guesses, taken)]


def best_drafts_by_depth(
    guesses: Sequence[Guess],
    rows: int,
    line: tuple[float, float],
    draft_line: tuple[float, float],
    room: int,
    slack: Sequence[float] | None,
) -> list[list[int]]:
    """A draft model's guesses, depth by depth: the requests drafting a j-th token share one
    draft-model step (d0 + d1 * requests, `draft_line`) and each adds a row (c1 of `line`); a
    depth runs for the requests of best gain k_j (a^j), as many as give the most expected tokens
    per second, and only if that beats stopping at the depth before (a step's fixed cost is
    shared: one request alone may not pay it where several do); none unless all of them together
    beat no drafts by DRAFT_MARGIN and every request keeps its pace."""
    (c0, c1), (d0, d1) = line, draft_line
    taken = [0] * len(guesses)
    expected, seconds = float(rows), c0 + c1 * rows
    for depth in range(1, max((len(draft) for draft, _ in guesses), default=0) + 1):
        level = sorted(
            (
                (chances[depth - 1], i)
                for i, (draft, chances) in enumerate(guesses)
                if taken[i] == depth - 1 and len(draft) >= depth
            ),
            key=lambda c: (-c[0], c[1]),
        )
        best_rate, best_count, gains = expected / seconds, 0, 0.0
        for count, (gain, _) in enumerate(level[:room], 1):
            gains += gain
            rate = (expected + gains) / (seconds + d0 + (c1 + d1) * count)
            if rate > best_rate:
                best_rate, best_count = rate, count
        if best_count == 0:
            break
        for gain, i in level[:best_count]:
            taken[i] = depth
            expected += gain
        seconds += d0 + (c1 + d1) * best_count
        room -= best_count
    plain = c0 + c1 * rows
    if expected / seconds < rows / plain * (1.0 + DRAFT_MARGIN):
        return [[] for _ in guesses]
    banked = slack_tokens(slack, len(guesses), plain)
    slowest = min(
        sum(chances[:count]) + credit for (_, chances), count, credit in zip(guesses, taken, banked)
    )
    if not keeps_pace(slowest, seconds, plain):
        return [[] for _ in guesses]
    return [draft[:count] for (draft, _), count in zip(guesses, taken)]


def keeps_pace(gain: float, seconds: float, plain_seconds: float) -> bool:
    """Whether a request expecting `gain` kept drafts in a step of `seconds` gets at least
    1 - SLOWDOWN_ALLOWED of the tokens per second of a step without drafts (`plain_seconds`)."""
    return (1.0 + gain) * plain_seconds >= (1.0 - SLOWDOWN_ALLOWED) * seconds


def slack_tokens(slack: Sequence[float] | None, count: int, plain_seconds: float) -> list[float]:
    """Requests' banked seconds as the kept drafts that would make up for them in keeps_pace
    (a step of `plain_seconds`); zeros where no slack is given."""
    if slack is None:
        return [0.0] * count
    return [banked * (1.0 - SLOWDOWN_ALLOWED) / plain_seconds for banked in slack]


def bank_slack(slack: float, emitted: int, plain_seconds: float, seconds: float) -> float:
    """A request's slack after a step of `seconds` in which it emitted `emitted` tokens: what
    they would have cost in plain steps, less SLOWDOWN_ALLOWED, against the step, up to
    BANKED_STEPS plain steps. Never below none: drafts are chosen by their expected gain, and a
    request whose drafts failed is not held back for it (alone, it would stop drafting after bad
    luck that the batch's rate already weighed: the document prompts at batch 1 1.54x -> 1.44x)."""
    earned = slack + emitted * plain_seconds / (1.0 - SLOWDOWN_ALLOWED) - seconds
    return min(max(earned, 0.0), BANKED_STEPS * plain_seconds)


def geometric(acceptance: float, depth: int) -> list[float]:
    """The chances a^j, j = 1..depth, that a draft keeps its first j tokens where each is kept
    with probability a when the one before it was."""
    return [acceptance**j for j in range(1, depth + 1)]
