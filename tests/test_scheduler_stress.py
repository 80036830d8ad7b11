"""A seeded random stress test of the scheduler over every configuration axis: it never
raises, every request ends, greedy outputs equal HF's, and no page leaks."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from helpers import assert_all_pages_free, build_llm, greedy, hf_greedy

from minisgl.utils import div_ceil

ARCH = "qwen3"
CHUNK = 16  # max_prefill_length: prompts reach 3x this
MAX_OUTPUT = 14
AXES = dict(
    page_size=(1, 4, 16),
    overlap_schedule=(False, True),
    cache_type=("radix", "naive"),
    schedule_policy=("fcfs", "lpm"),
    pool=("smallest", "tight", "ample"),
)


@dataclass
class Arrival:
    step: int
    prompt: int  # index into the prompt pool
    max_tokens: int
    abort_after: int | None  # steps after arrival; None: runs to the end


def _prompt_pool(rng: random.Random) -> list[list[int]]:
    """Prompts of 1 to 3x the chunk budget; some share prefixes (radix hits, lpm order)."""
    stems = [
        [rng.randrange(100, 40000) for _ in range(rng.randint(4, 2 * CHUNK))] for _ in range(3)
    ]
    pool = []
    for i in range(14):
        length = rng.randint(1, 3 * CHUNK)
        head = stems[i % 3][:length] if i % 2 == 0 else []
        pool.append(head + [rng.randrange(100, 40000) for _ in range(length - len(head))])
    return pool


def _configs(rng: random.Random) -> list[dict]:
    """A covering sample of the axes' product: every value of every axis appears."""
    product = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
    rng.shuffle(product)
    picked: list[dict] = []
    for config in product:
        new = any(all(c[k] != v for c in picked) for k, v in config.items())
        if new or len(picked) < 16:
            picked.append(config)
        if len(picked) >= 16 and all(
            {c[k] for c in picked} == set(values) for k, values in AXES.items()
        ):
            break
    return picked


def _run(config: dict, pool: list[list[int]], expected: list[list[int]], seed: int) -> dict:
    """One configuration under random traffic; returns what happened (for coverage)."""
    rng = random.Random(seed)
    ps = config["page_size"]
    arrivals = [
        Arrival(
            step=rng.randint(0, 24),
            prompt=rng.randrange(len(pool)),
            max_tokens=rng.randint(1, MAX_OUTPUT),
            abort_after=rng.randint(0, 12) if rng.random() < 0.2 else None,
        )
        for _ in range(24)
    ]
    largest = max(div_ceil(len(pool[a.prompt]) + a.max_tokens, ps) for a in arrivals)
    num_pages = {"smallest": largest, "tight": 2 * largest, "ample": 40 * largest}[config["pool"]]
    llm = build_llm(
        ARCH,
        page_size=ps,
        num_page_override=num_pages,
        max_running_req=rng.randint(2, 8),
        max_prefill_length=CHUNK,
        overlap_schedule=config["overlap_schedule"],
        cache_type=config["cache_type"],
        schedule_policy=config["schedule_policy"],
    )
    # Optimistic as after warm-up traffic (always so in the smallest pool: retractions), or not.
    ratios = [0.1] if config["pool"] == "smallest" else [0.1, 0.7, 1.0]
    llm.budget.new_token_ratio = rng.choice(ratios)
    uids: dict[int, Arrival] = {}
    arrived_at: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    step = 0
    while step <= 24 or llm.has_work:
        for arrival in (a for a in arrivals if a.step == step):
            uid = llm.add_request(pool[arrival.prompt], greedy(arrival.max_tokens))
            uids[uid], arrived_at[uid], tokens[uid] = arrival, step, []
        for uid, arrival in uids.items():
            due = arrival.abort_after is not None and arrived_at[uid] + arrival.abort_after == step
            if due and uid not in finish:
                llm.abort_request(uid)
        for out in llm.step() if llm.has_work else []:
            assert out.uid not in finish, f"request {out.uid} finished twice"
            if out.token is not None:
                tokens[out.uid].append(out.token)
            if out.finish_reason is not None:
                finish[out.uid] = out.finish_reason
        step += 1
        assert step < 2000, f"no progress: {llm.running=} {llm.waiting=} {llm.chunked=}"
    assert set(finish) == set(uids), "every request ends"
    for uid, arrival in uids.items():
        want = expected[arrival.prompt][: arrival.max_tokens]
        if finish[uid] == "abort":
            assert tokens[uid] == want[: len(tokens[uid])], f"{config} request {uid}"
        else:
            ended = "stop" if want[-1] in llm.eos_ids else "length"
            assert (finish[uid], tokens[uid]) == (ended, want), f"{config} request {uid}"
    assert_all_pages_free(llm)
    seen = dict(
        retractions=llm.stats.retractions,
        aborts=sum(f == "abort" for f in finish.values()),
        cached=llm.stats.cached_tokens,
    )
    llm.shutdown()
    return seen


def test_random_traffic_over_every_configuration_axis() -> None:
    rng = random.Random(19)
    pool = _prompt_pool(rng)
    expected = hf_greedy(ARCH, pool, MAX_OUTPUT)
    configs = _configs(rng)
    for key, values in AXES.items():
        assert {c[key] for c in configs} == set(values), f"axis {key} not covered"
    seen = [_run(config, pool, expected, seed=100 + i) for i, config in enumerate(configs)]
    # The traffic reached what it is for: retraction, aborts and prefix-cache hits.
    for what in ("retractions", "aborts", "cached"):
        assert sum(s[what] for s in seen) > 0, f"no {what} in any configuration"


@pytest.mark.parametrize("seed", [1, 2])
def test_smallest_pool_with_many_long_requests(seed: int) -> None:
    """The pool holds exactly the largest request: retraction and waiting chunks, no crash."""
    rng = random.Random(seed)
    pool = _prompt_pool(rng)
    expected = hf_greedy(ARCH, pool, MAX_OUTPUT)
    config = dict(
        page_size=4, overlap_schedule=seed == 2, cache_type="radix", schedule_policy="lpm"
    )
    _run(dict(config, pool="smallest"), pool, expected, seed=seed)
