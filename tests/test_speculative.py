"""Speculative decoding (n-gram drafts): greedy output equals decoding without it (and HF) token
for token in every configuration, sampled output has the same distribution, and the pages of
rejected drafts come back."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    LONG_TEXT,
    MIXED_PROMPTS,
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_greedy,
    model_path,
)

from minisgl.core import SamplingParams, StructuredOutput
from minisgl.kernel.cpu import cpu_kernels
from minisgl.llm import LLM
from minisgl.scheduler import SchedulerConfig

NGRAM = dict(speculative_algorithm="NGRAM")
# Text that repeats itself: random-weight models loop too, so drafts get accepted and rejected.
REPEATS = "one two three four five six one two three four five six one two three"
PROMPTS: list[str | list[int]] = [*MIXED_PROMPTS, REPEATS, [7, 8, 9, 7, 8, 9, 7, 8]]
# Lengths ending at and off every draft boundary (drafts are at most 7 per step).
MAX_NEW = [1, 2, 9, 24, 40, 16, 3, 33, 40, 17]


@pytest.fixture(autouse=True)
def every_draft(request, monkeypatch):
    """Every draft verified, whatever the cost model would keep (it decides by timing, which
    varies by machine): these tests check the verification; test_cost_model_* the policy."""
    from minisgl.scheduler.speculative import Speculator

    if "cost_model" not in request.node.name:
        monkeypatch.setattr(
            Speculator, "_worth_it", lambda self, guesses, rows, slack=None: [g for g, _ in guesses]
        )
        monkeypatch.setattr(Speculator, "_catch_up_loses", lambda self, req, drafts, rows: False)


def generate(llm: LLM, prompts: list, params: list[SamplingParams] | SamplingParams) -> list[dict]:
    """The outputs, every page of the target's pool (and a draft model's) free or cached after."""
    outputs = llm.generate(prompts, params)
    assert_all_pages_free(llm)
    if llm.speculator is not None:
        llm.speculator.check_integrity()  # no draft KV kept, every draft page free
    return outputs


def spec_and_plain(
    name: str, prompts: list, params, speculation: dict = NGRAM, **kw
) -> tuple[list[dict], list[dict], LLM]:
    """The outputs with speculation and without it (and the speculating LLM, shut down)."""
    llm = build_llm(name, **speculation, **kw)
    try:
        spec = generate(llm, prompts, params)
    finally:
        llm.shutdown()
    plain_llm = build_llm(name, **kw)
    try:
        plain = generate(plain_llm, prompts, params)
    finally:
        plain_llm.shutdown()
    return spec, plain, llm


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


@pytest.mark.parametrize(
    ("arch", "page_size"),
    [
        ("qwen3", 1),
        ("qwen3", 4),
        ("qwen3", 16),
        ("llama3", 1),
        ("qwen2", 4),
        ("mistral", 16),
        ("qwen3-moe", 1),
        ("qwen3-kv1", 4),
    ],
)
def test_greedy_equals_decoding_without_it_and_hf(arch: str, page_size: int) -> None:
    params = [greedy(n) for n in MAX_NEW]
    # Fewer running slots than prompts: verify steps mix with prefills joining the batch.
    spec, plain, llm = spec_and_plain(arch, PROMPTS, params, page_size=page_size, max_running_req=4)
    assert token_ids(spec) == token_ids(plain) == hf_greedy(arch, PROMPTS, MAX_NEW)
    assert [o["finish_reason"] for o in spec] == [o["finish_reason"] for o in plain]
    stats = llm.speculator.stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens


def test_radix_hits_chunked_prefill_and_a_second_round() -> None:
    """Chunks of 16 tokens, then the same prompts again from the prefix cache (and the shared
    n-gram cache, which the finished requests fed)."""
    params = [greedy(n) for n in MAX_NEW]
    llm = build_llm("qwen3", max_prefill_length=16, **NGRAM)
    try:
        first = generate(llm, PROMPTS, params)
        again = generate(llm, PROMPTS, params)
        assert sum(o["cached_tokens"] for o in again) > 0
        assert len(llm.speculator.cache) > 0
    finally:
        llm.shutdown()
    assert token_ids(first) == token_ids(again) == hf_greedy("qwen3", PROMPTS, MAX_NEW)


def test_retraction_under_page_pressure() -> None:
    """A pool too small for every request's output: decode retracts, drafts never evict."""
    prompts = [LONG_TEXT, REPEATS, LONG_TEXT[:120], "1, 2, 3, 4, 5,"] * 2
    params = greedy(60, ignore_eos=True)
    spec, plain, llm = spec_and_plain("qwen3", prompts, params, num_page_override=260)
    assert llm.stats.retractions > 0
    assert token_ids(spec) == token_ids(plain)


def test_stop_tokens_and_max_tokens_inside_an_accepted_run() -> None:
    """A stop token id that the plain output reaches mid-way ends the speculative one at the same
    place, with nothing after it; max_tokens cuts a run of accepted drafts."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    plain_llm = build_llm("qwen3")
    reference = plain_llm.generate([prompt], greedy(40))[0]["token_ids"]
    plain_llm.shutdown()
    stop = reference[12]
    first = reference.index(stop)
    params = [greedy(40, stop_token_ids=[stop]), *[greedy(n) for n in range(1, 12)]]
    spec, plain, llm = spec_and_plain("qwen3", [prompt] * len(params), params)
    assert token_ids(spec) == token_ids(plain)
    assert spec[0]["token_ids"] == reference[: first + 1] and spec[0]["finish_reason"] == "stop"
    assert [len(o["token_ids"]) for o in spec[1:]] == list(range(1, 12))
    assert llm.speculator.stats.accepted_tokens > 0


def test_logprobs_penalties_bias_and_min_tokens_as_decoded_one_by_one() -> None:
    """Every position of a verify step is sampled with what it would have known decoded alone:
    penalties count the drafts before it, min_tokens holds off EOS, logit_bias applies."""
    params = [
        greedy(30, logprobs=3),
        greedy(30, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        greedy(30, logit_bias={7: 4.0, 9: 3.0}),
        greedy(30, min_tokens=20, stop_token_ids=[8, 9]),
        greedy(30, logprobs=0, frequency_penalty=1.0),
    ]
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8]] * 2 + [REPEATS] * 3
    spec, plain, _ = spec_and_plain("qwen3", prompts, params)
    assert token_ids(spec) == token_ids(plain)
    for s, p in zip(spec, plain):
        if p.get("logprobs") is None:
            continue
        assert [e[0] for e in s["logprobs"]] == [e[0] for e in p["logprobs"]]
        for (_, got, got_top), (_, want, want_top) in zip(s["logprobs"], p["logprobs"]):
            assert got == pytest.approx(want, abs=1e-4)
            assert [t for t, _ in got_top] == [t for t, _ in want_top]


def test_constrained_requests_verify_the_drafts_their_grammar_takes(monkeypatch) -> None:
    """Structured output with drafts: a constrained request's drafts are cut to what its grammar
    takes, each verify position is masked by the grammar after the drafts before it, and the
    output equals decoding without speculation. The drafts are an oracle's (the plain run's next
    tokens, then a wrong one), so they reach verification whatever the CPU class's numerics."""
    from minisgl.scheduler.speculative import Speculator

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "boolean"}},
        "required": ["name", "n"],
    }
    json_output = StructuredOutput("json", json.dumps(schema))
    choice = StructuredOutput("choice", json.dumps(["one two three four five", "six seven"]))
    params = [greedy(200, structured=json_output), greedy(60, structured=choice), greedy(30)]
    prompts: list = ["Give me JSON:", REPEATS, [7, 8, 9, 7, 8, 9, 7, 8]]
    plain_llm = build_llm("qwen3")
    try:
        plain = generate(plain_llm, prompts, params)
        keys = [tuple(plain_llm._encode(p)) for p in prompts]
    finally:
        plain_llm.shutdown()
    reference = {key: out["token_ids"] for key, out in zip(keys, plain)}

    def oracle(self, req, limit):
        done = req.input_ids[req.prompt_len :].tolist()
        want = reference[tuple(req.input_ids[: req.prompt_len].tolist())]
        if limit <= 0 or want[: len(done)] != done or len(done) >= len(want):
            return [], 0.0
        right = want[len(done) : len(done) + limit - 1]
        after = len(done) + len(right)
        wrong = [want[after] ^ 1] if after < len(want) else []
        return [*right, *wrong][:limit], 0.9

    verified: dict[int, list[int]] = {}
    record = Speculator.record

    def spy(self, req, drafted, accepted):
        if req.grammar is not None:
            verified.setdefault(req.uid, []).append(accepted)
        record(self, req, drafted, accepted)

    monkeypatch.setattr(Speculator, "_ngram_guess", oracle)
    monkeypatch.setattr(Speculator, "record", spy)
    llm = build_llm("qwen3", **NGRAM)
    try:
        spec = generate(llm, prompts, params)
    finally:
        llm.shutdown()
    assert token_ids(spec) == token_ids(plain)
    assert [o["finish_reason"] for o in spec] == [o["finish_reason"] for o in plain]
    assert set(json.loads(spec[0]["text"])) == {"name", "n"}
    assert spec[1]["text"] in ("one two three four five", "six seven")
    # Both constrained requests verified drafts, and kept some.
    assert len(verified) == 2 and all(sum(kept) > 0 for kept in verified.values()), verified


@pytest.mark.parametrize(
    ("arch", "quantization"),
    [("qwen3-pad", None), ("qwen3-moe", None), ("llama3", "int8"), ("qwen2", "int4")],
)
def test_bf16_greedy_and_seeded_outputs_equal_decoding_without_it(arch, quantization) -> None:
    """In bf16 (dense on the C GEMV and matmul, MoE experts, quantized tiles) a verify step's
    rows are the bits decoding one by one gives: greedy and seeded sampled outputs equal those
    without speculation, n-gram drafts and a draft model's, verify steps beside prefills."""
    kernels = cpu_kernels()
    if arch == "qwen3-moe" and kernels is not None and kernels.has_amx:
        pytest.skip("with AMX an expert's 5th bf16 row leaves the GEMV for the tiles")
    kw: dict = dict(dtype=torch.bfloat16, max_running_req=3, max_prefill_length=16)
    if quantization is not None:
        kw["quantization"] = quantization
    steered = {101: 14.0, 202: 13.0, 303: 12.5}  # most mass on the prompt's tokens: drafts hold
    params = (
        [
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=seed, logit_bias=steered)
            for seed in range(3)
        ]
        + [greedy(n) for n in (40, 17, 33)]
        + [greedy(24, logit_bias=steered)]
    )
    steering = [101, 303, 202, 303, 202, 303, 202, 303]
    prompts = [steering, steering, REPEATS, "Hello, my name is", *PROMPTS[:2], steering]
    draft = dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=str(model_path(arch))
    )
    for speculation in (NGRAM, draft):
        spec, plain, llm = spec_and_plain(arch, prompts, params, speculation, **kw)
        assert token_ids(spec) == token_ids(plain), speculation
        # (a random draft model's guesses seldom hold: its drafts reached verification)
        stats = llm.speculator.stats
        assert (stats.accepted_tokens if speculation is NGRAM else stats.verify_steps) > 0, stats


def test_tensor_parallel_verify_steps_replay() -> None:
    params = [greedy(n) for n in MAX_NEW]
    spec, plain, llm = spec_and_plain("qwen3-kv1", PROMPTS, params, tp_size=2, page_size=4)
    assert token_ids(spec) == token_ids(plain)
    assert llm.speculator.stats.accepted_tokens > 0


def _chi2_p_value(a: list[str], b: list[str]) -> float:
    """Two-sample chi-square test of homogeneity; categories with fewer than 10 samples in all
    are pooled."""
    counts: dict[str, list[int]] = {}
    for i, sample in enumerate((a, b)):
        for key in sample:
            counts.setdefault(key, [0, 0])[i] += 1
    table, rare = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            table.append(pair)
        else:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
    if sum(rare):
        table.append(rare)
    observed = torch.tensor(table, dtype=torch.float64)
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(table) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def _samples(speculate: bool, count: int) -> tuple[list[str], int]:
    """The first four tokens of `count` samples at temperature 1 (top-p, penalties and a
    logit_bias that puts most mass on three tokens, the prompt's), and the drafts accepted."""
    # The drafts (what followed each token in the prompt) are never 101, the likeliest token.
    prompt = [101, 303, 202, 303, 202, 303, 202, 303]
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        presence_penalty=0.4,
        repetition_penalty=1.1,
        logit_bias={101: 14.0, 202: 13.0, 303: 12.5},
        max_tokens=4,
        ignore_eos=True,
    )
    llm = build_llm("qwen3", max_running_req=8, **(NGRAM if speculate else {}))
    try:
        torch.manual_seed(0)
        outputs = generate(llm, [prompt] * count, params)
        accepted = llm.speculator.stats.accepted_tokens if llm.speculator else 0
    finally:
        llm.shutdown()
    return [" ".join(map(str, o["token_ids"])) for o in outputs], accepted


def test_sampling_has_the_distribution_of_decoding_without_speculation(monkeypatch) -> None:
    import minisgl.scheduler.results as results
    from minisgl.scheduler.speculative import Speculator

    # Every draft verified, whatever the cost model would keep: the rule is what is tested.
    monkeypatch.setattr(
        Speculator, "_worth_it", lambda self, guesses, rows, slack=None: [g for g, _ in guesses]
    )
    plain, _ = _samples(False, 400)
    spec, accepted = _samples(True, 400)
    assert accepted > 130  # drafts were verified and kept, not merely proposed
    assert _chi2_p_value(plain, spec) > 1e-3
    # The test can tell: keeping the first draft whatever was sampled skews the distribution.
    monkeypatch.setattr(results, "accepted_length", lambda draft, sampled: min(1, len(draft)))
    wrong, _ = _samples(True, 400)
    assert _chi2_p_value(plain, wrong) < 1e-6


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_a_seeded_request_samples_the_tokens_it_samples_without_speculation(arch: str) -> None:
    """A seeded draw is fixed by the seed and the token's index, not by the draws before it (a
    verify step's rejected positions draw too): with speculation a seeded request samples the
    tokens decoding one by one samples, with top-p, top-k, min-p, penalties, logit_bias and
    min_tokens. (MoE: a token's experts give it the same bits however many tokens share them;
    F.linear on the stacked experts did not, and a sampled token parted at a near tie.)"""
    steered = {101: 14.0, 202: 13.0, 303: 12.5}  # most mass on the prompt's tokens: drafts hold
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, logit_bias=steered, max_tokens=24, seed=7),
        SamplingParams(
            temperature=0.8,
            top_k=3,
            repetition_penalty=1.1,
            logit_bias=steered,
            max_tokens=24,
            seed=-3,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=1.2,
            min_p=0.05,
            presence_penalty=0.4,
            logit_bias=steered,
            min_tokens=12,
            max_tokens=24,
            seed=2**63 - 1,
        ),
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=7),
    ]
    prompt = [101, 303, 202, 303, 202, 303, 202, 303]
    spec, plain, llm = spec_and_plain(arch, [prompt, prompt, prompt, REPEATS], params)
    assert token_ids(spec) == token_ids(plain)
    stats = llm.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts both kept and rejected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("speculative_algorithm", "EAGLE9"),
        ("speculative_num_draft_tokens", 1),
        ("speculative_ngram_min_match_window_size", 0),
        ("speculative_ngram_capacity", -1),
    ],
)
def test_bad_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(model_path="unused", **{field: value})


def test_served_with_speculation_reports_it_and_equals_offline(tmp_path) -> None:
    """The server's flags: /generate equals offline decoding without speculation, its
    meta_info carries SGLang's spec_verify_ct, and /metrics counts drafted and accepted tokens."""
    import httpx
    from helpers import hf_encode, tiny_model
    from test_server import SERVER_ARGS, metrics, start_server, wait_for

    prompts = [REPEATS, [7, 8, 9, 7, 8, 9, 7, 8]]
    offline = build_llm("qwen3")
    expected = [o["text"] for o in offline.generate(prompts, greedy(40))]
    offline.shutdown()
    args = [*SERVER_ARGS, "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6"]
    server = start_server(tiny_model("qwen3"), args, tmp_path / "server.log")
    try:
        body = {
            "input_ids": [hf_encode("qwen3", p) for p in prompts],
            "sampling_params": {"temperature": 0, "max_new_tokens": 40},
        }
        outs = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        assert [o["text"] for o in outs] == expected
        meta = [o["meta_info"] for o in outs]
        assert all(m["spec_verify_ct"] > 0 and m["spec_accept_length"] > 1 for m in meta)
        samples = wait_for(
            lambda: (
                (m := metrics(server.url)).get("minisgl_spec_tokens_total{kind=accepted}") and m
            ),
            what="speculative counters",
        )
        assert (
            samples["minisgl_spec_tokens_total{kind=drafted}"]
            >= samples["minisgl_spec_tokens_total{kind=accepted}"]
        )
        assert samples["minisgl_spec_accept_length"] > 1
    finally:
        server.stop()


def test_cost_model_drafts_where_rows_are_cheap_and_not_where_dear() -> None:
    """The policy: drafts while a row costs little against a step and guesses are good; none
    where a row costs as much as the step (a compute-bound CPU) or guesses are poor."""
    from minisgl.scheduler.spec_choice import geometric
    from minisgl.scheduler.spec_cost import StepCost
    from minisgl.scheduler.speculative import Speculator

    def drafts(row_seconds: float, acceptance: float, batch: int, base: float = 0.010) -> list[int]:
        spec = Speculator(8, 1, 4, 8, 0)
        for rows in (batch, batch + 4, batch + 8):
            for _ in range(5):
                spec.cost.observe(rows, base + row_seconds * rows)
        guesses = [([1, 2, 3, 4, 5, 6, 7], geometric(acceptance, 7))] * batch
        return [len(d) for d in spec._worth_it(guesses, batch)]

    assert drafts(0.0002, 0.8, 1) == [7]  # memory-bound: each row ~2% of a step
    assert 0 < sum(drafts(0.0002, 0.8, 16)) < 7 * 16  # a large batch: fewer
    assert drafts(0.010, 0.8, 1, base=0.0005) == [0]  # a row costs a whole step
    assert drafts(0.0002, 0.01, 1) == [0]  # guesses that never hold
    fresh = StepCost()
    assert fresh.coefficients() == (1.0, fresh.row_cost)  # nothing measured: optimistic
    # A row bound (AVX2's quantized tiles past 16 rows): a verify step stays within its batch's.
    bounded = Speculator(8, 1, 4, 8, 0, row_bounds=[16, 64])
    for rows in (12, 16, 20):
        for _ in range(5):
            bounded.cost.observe(rows, 0.010 + 0.0002 * rows)
    for batch, most in ((12, 4), (16, 0), (17, 64 - 17), (64, 0), (65, 7 * 65)):
        guesses = [([1, 2, 3, 4, 5, 6, 7], geometric(0.95, 7))] * batch
        assert sum(map(len, bounded._worth_it(guesses, batch))) <= most, batch
    # Room for 4 drafts among 12 requests: the 8 left without any would be slowed; a row is 1.6%
    # of their step, so one draft row keeps their pace (SLOWDOWN_ALLOWED) and a second does not.
    # Two requests whose guesses both hold take all of them.
    assert sum(map(len, bounded._worth_it([([1, 2, 3], geometric(0.95, 3))] * 12, 12))) == 1
    assert sum(map(len, bounded._worth_it([([1, 2, 3], geometric(0.95, 3))] * 2, 2))) == 6


def test_cost_model_keeps_every_requests_pace() -> None:
    """Drafts for some requests of a batch make its step dearer for all: where a row costs a
    tenth of a step, a request with good guesses beside one without drafts nothing (the other
    would decode ~10% slower), alone it drafts, and beside one whose guesses hold too both do;
    where rows cost 1% of a step, its drafts are taken beside the other."""
    from minisgl.scheduler.spec_choice import SLOWDOWN_ALLOWED, geometric, keeps_pace
    from minisgl.scheduler.speculative import Speculator

    def taken(row_seconds: float, guesses: list) -> list[int]:
        spec = Speculator(8, 1, 4, 8, 0)
        for rows in range(1, 12):
            for _ in range(5):
                spec.cost.observe(rows, 0.010 + row_seconds * rows)
        return [len(d) for d in spec._worth_it(guesses, len(guesses))]

    good, none = ([1, 2, 3, 4], geometric(0.9, 4)), ([], [])
    assert taken(0.001, [good, none]) == [0, 0]
    assert taken(0.001, [good])[0] > 0
    assert min(taken(0.001, [good, good])) > 0
    assert taken(0.0001, [good, none])[0] > 0
    assert keeps_pace(0.0, 1.0 - SLOWDOWN_ALLOWED / 2, 1.0) and not keeps_pace(0.0, 1.1, 1.0)


def test_cost_model_keeps_the_pace_over_a_requests_decode() -> None:
    """The pace is kept over a request's decode: one whose drafts were kept (or that decoded
    long without drafts) banks slack, which lets another's good guesses slow its step where it
    has none; a fresh request, or one with little banked, stops them as before. The bank is
    capped, never negative, and the requests that finished bank nothing."""
    from types import SimpleNamespace

    from minisgl.scheduler.spec_choice import BANKED_STEPS, SLOWDOWN_ALLOWED, bank_slack
    from minisgl.scheduler.speculative import Speculator, geometric

    spec = Speculator(8, 1, 4, 8, 0)
    for rows in range(1, 12):
        for _ in range(5):
            spec.cost.observe(rows, 0.010 + 0.001 * rows)  # a row: 1/12 of a 2-row step
    good, none = ([1, 2, 3, 4], geometric(0.9, 4)), ([], [])
    plain = spec.cost.seconds(2, spec.cost.coefficients())
    assert [len(d) for d in spec._worth_it([good, none], 2, [0.0, 0.0])] == [0, 0]
    assert [len(d) for d in spec._worth_it([good, none], 2, [0.0, 0.2 * plain])][0] > 0
    # The slack pays for the rows taken: a little buys one row, not four.
    assert [len(d) for d in spec._worth_it([good, none], 2, [0.0, 0.1 * plain])][0] == 1
    # A draft model's depths likewise (its steps cost a tenth of a target step, DRAFT_MARGIN).
    spec.drafter = SimpleNamespace()
    assert spec._worth_it([good, none], 2, [0.0, 0.0]) == [[], []]
    assert spec._worth_it([good, none], 2, [0.0, 2 * plain])[0]
    spec.drafter = None

    # Banking: kept drafts earn their plain steps' seconds, a step's cost is spent.
    step = 0.012
    assert bank_slack(0.0, 1, step, step) == pytest.approx(step * SLOWDOWN_ALLOWED / 0.97)
    assert bank_slack(0.0, 3, step, 1.5 * step) == pytest.approx(3 * step / 0.97 - 1.5 * step)
    assert bank_slack(0.0, 1, step, 2 * step) == 0.0
    assert bank_slack(0.0, 100, step, step) == BANKED_STEPS * step

    class Running:  # (a request as settle reads it: weakly referenced, finished or not)
        def __init__(self, finish_reason: str | None) -> None:
            self.finish_reason = finish_reason

    reqs = [Running(None), Running("stop")]
    for req in reqs:
        spec.state(req)
    spec.settle(reqs, [4, 1], 5)
    assert spec.state(reqs[0]).slack > 0 and spec.state(reqs[1]).slack == 0.0


def test_cost_model_judges_ngram_drafts_by_their_match_length() -> None:
    """N-gram drafts of long matches that held, and of 1-token matches that failed: where a row
    costs a third of a step, the long match's drafts are taken and the short one's not; a depth
    the cost model never reached is judged by the one before it."""
    from minisgl.scheduler.speculative import Speculator

    spec = Speculator(8, 1, 4, 8, 0)
    for rows in (1, 2, 3):
        for _ in range(5):
            spec.cost.observe(rows, 0.010 + 0.003 * rows)
    short, long = spec.matches.key(False, 1), spec.matches.key(False, 9)
    assert long == spec.matches.key(False, 4)  # lengths past MATCH_LENGTHS share one estimate
    for _ in range(30):
        spec.matches.observe(short, 2, 0)
        spec.matches.observe(long, 2, 2)
    chances = spec.matches.survival(long)
    assert chances[0] > 0.9 and chances[6] > 0.5  # depths 3-7 never verified: as depth 2
    assert spec.matches.survival(short)[0] < 0.1
    # (each alone: beside a request without drafts, any draft row would slow it by a fifth)
    assert len(spec._worth_it([([1] * 7, spec.matches.survival(long))], 1)[0]) >= 2
    assert spec._worth_it([([2] * 7, spec.matches.survival(short))], 1) == [[]]
