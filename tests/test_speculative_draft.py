"""Speculative decoding with a draft model (STANDALONE): greedy output equals decoding without
it token for token, the draft's own pool comes back whole, and bad settings are refused by
name. The draft is the target's own model (every draft kept: accepted runs are long) or another
model of its vocabulary (drafts rejected)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import LONG_TEXT, build_llm, greedy, model_path
from test_speculative import MAX_NEW, PROMPTS, REPEATS, every_draft, token_ids  # noqa: F401
from test_speculative import generate as run
from test_speculative import spec_and_plain as speculation_and_plain

from minisgl.core import Req, SamplingParams, StructuredOutput
from minisgl.llm import LLM
from minisgl.scheduler import SchedulerConfig
from minisgl.server.args import parse_args


def standalone(draft: str) -> dict:
    """LLM settings for drafting with the named test model."""
    return dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=str(model_path(draft))
    )


def draft_llm(name: str, draft: str, **kw) -> LLM:
    return build_llm(name, **standalone(draft), **kw)


def spec_and_plain(name: str, draft: str, prompts: list, params, **kw) -> tuple[list, list, LLM]:
    """The outputs with a draft model and without speculation (and the drafting LLM)."""
    return speculation_and_plain(name, prompts, params, standalone(draft), **kw)


@pytest.mark.parametrize(
    ("arch", "draft", "page_size"),
    [("qwen3", "qwen3", 1), ("qwen3", "llama3", 16), ("llama3", "qwen3-kv1", 4)],
)
def test_greedy_equals_decoding_without_it(arch: str, draft: str, page_size: int) -> None:
    params = [greedy(n) for n in MAX_NEW]
    # Fewer running slots than prompts: verify steps mix with prefills joining the batch.
    spec, plain, llm = spec_and_plain(
        arch, draft, PROMPTS, params, page_size=page_size, max_running_req=4
    )
    assert token_ids(spec) == token_ids(plain)
    assert [o["finish_reason"] for o in spec] == [o["finish_reason"] for o in plain]
    stats = llm.speculator.stats
    if draft == arch:  # the same model drafts what the target decodes
        assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    else:  # another random model: its guesses mostly fail
        assert stats.draft_tokens > stats.accepted_tokens


def test_a_short_catch_up_runs_as_a_decode_step_with_the_drafts_of_a_prefill(monkeypatch) -> None:
    """A catch-up of a few tokens a request (those since its last verify step) runs in the
    verify step's form; its drafts are those the prefill form gives."""
    from minisgl.scheduler import draft_model

    def proposals(decode_catch_up: int) -> tuple[list[list[list[int]]], list[int]]:
        monkeypatch.setattr(draft_model, "DECODE_CATCH_UP", decode_catch_up)
        llm = draft_llm("qwen3", "qwen3", max_running_req=4)
        drafter, made, shapes = llm.speculator.drafter, [], []
        propose = drafter.propose

        def recorded(reqs, counts):
            made.append(propose(reqs, counts))
            shapes.append(len(drafter.step_seconds))
            return made[-1]

        drafter.propose = recorded
        try:
            run(llm, PROMPTS, [greedy(n) for n in MAX_NEW])
        finally:
            llm.shutdown()
        return made, shapes

    decoded, decode_forwards = proposals(draft_model.DECODE_CATCH_UP)
    prefilled, prefill_forwards = proposals(0)
    assert decoded == prefilled
    # every proposal's forwards but the prefill one are decode forwards: one more each here
    assert sum(decode_forwards) > sum(prefill_forwards)


def test_radix_hits_chunked_catch_up_and_a_second_round() -> None:
    """Prefill (and the draft's catch-up) in chunks of 16 tokens, then the same prompts again
    from the prefix cache: the draft's own cache holds what the first round computed."""
    params = [greedy(n) for n in MAX_NEW]
    llm = draft_llm("qwen3", "qwen3", max_prefill_length=16, page_size=4)
    try:
        first = run(llm, PROMPTS, params)
        drafter = llm.speculator.drafter
        hits = drafter.hit_tokens
        again = run(llm, PROMPTS, params)
        assert sum(o["cached_tokens"] for o in again) > 0
        # (a request of one token never drafts: its prompt has no draft KV to find)
        drafted = [o["cached_tokens"] for o, n in zip(again, MAX_NEW) if n > 1]
        assert drafter.hit_tokens - hits >= sum(drafted) > 0
        assert llm.speculator.stats.accepted_tokens > 0
    finally:
        llm.shutdown()
    plain = build_llm("qwen3", page_size=4)
    try:
        assert token_ids(first) == token_ids(again) == token_ids(run(plain, PROMPTS, params))
    finally:
        plain.shutdown()


def test_retraction_under_page_pressure() -> None:
    """Pools too small for every request's output: decode retracts (a retracted request's draft
    KV goes to the draft's prefix cache, which it and the requests sharing its prompt find, and
    which evicts when the draft's pool runs short), and a request whose draft KV does not fit
    drafts nothing."""
    prompts = [LONG_TEXT, REPEATS, LONG_TEXT[:120], "1, 2, 3, 4, 5,"] * 2
    params = greedy(60, ignore_eos=True)
    spec, plain, llm = spec_and_plain("qwen3", "qwen3", prompts, params, num_page_override=260)
    assert llm.stats.retractions > 0
    assert token_ids(spec) == token_ids(plain)
    assert llm.speculator.stats.accepted_tokens > 0
    assert llm.speculator.drafter.hit_tokens > 0


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "boolean"}},
    "required": ["name", "n"],
}


def test_stops_max_tokens_and_penalties_inside_accepted_runs() -> None:
    """A stop token id, a stop string (an abort of the request), max_tokens and a JSON schema
    end the drafting output where they end the plain one, nothing after; penalties and
    logit_bias move the target's tokens off the draft's argmax now and then: some drafts are
    rejected mid-run, and the draft's KV after them is computed again."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    plain_llm = build_llm("qwen3")
    reference = plain_llm.generate([prompt], greedy(40))[0]
    plain_llm.shutdown()
    stop_token = reference["token_ids"][12]
    stop_text = reference["text"][len(reference["text"]) // 2 :][:3]
    params = [
        greedy(40, stop_token_ids=[stop_token]),
        greedy(40, stop=[stop_text]),
        *[greedy(n) for n in range(1, 12)],
        greedy(30, repetition_penalty=1.3),
        greedy(30, frequency_penalty=0.6, logit_bias={7: 3.0}),
        # Structured: the draft's argmax is cut to what the grammar takes, each position masked
        # by the grammar after the drafts before it.
        greedy(120, structured=StructuredOutput("json", json.dumps(SCHEMA))),
        # Sampled: drafts are kept where they equal the token sampled there.
        SamplingParams(temperature=0.8, max_tokens=30, seed=1, ignore_eos=True),
    ]
    spec, plain, llm = spec_and_plain("qwen3", "qwen3", [prompt] * len(params), params)
    assert token_ids(spec[:-1]) == token_ids(plain[:-1])
    assert [o["text"] for o in spec[:-1]] == [o["text"] for o in plain[:-1]]
    first = reference["token_ids"].index(stop_token)
    assert spec[0]["token_ids"] == reference["token_ids"][: first + 1]
    assert spec[0]["finish_reason"] == spec[1]["finish_reason"] == "stop"
    assert [len(o["token_ids"]) for o in spec[2:13]] == list(range(1, 12))
    assert len(spec[-1]["token_ids"]) == 30
    assert set(json.loads(spec[-2]["text"])) == set(SCHEMA["required"])
    stats = llm.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_tensor_parallel_target_with_its_draft_on_rank_0() -> None:
    """The draft runs on rank 0 only, the verify steps on both ranks: the output is a single
    rank's without speculation (tests/test_tp.py holds tp 2 to tp 1's tokens)."""
    params = [greedy(n) for n in MAX_NEW]
    llm = draft_llm("qwen3-kv1", "qwen3", tp_size=2, page_size=4)
    try:
        spec = run(llm, PROMPTS, params)
        assert llm.speculator.stats.draft_tokens > 0
    finally:
        llm.shutdown()
    plain = build_llm("qwen3-kv1", page_size=4)
    try:
        assert token_ids(spec) == token_ids(run(plain, PROMPTS, params))
    finally:
        plain.shutdown()


def test_the_draft_pool_has_the_targets_pages_paid_from_its_kv_budget(monkeypatch) -> None:
    from minisgl.env import ENV

    # 1 MiB: 256 token slots of the tiny Qwen3's KV (2 layers, 2 KV heads of 128, float32)
    # alone, 128 beside a draft pool of the same model.
    monkeypatch.setattr(ENV.CPU_KV_CACHE_GB, "value", 2**20 / 2**30)
    llm = draft_llm("qwen3", "qwen3", num_page_override=None)
    try:
        drafter = llm.speculator.drafter
        assert llm.engine.num_pages == drafter.engine.num_pages == 128
        assert drafter.engine.config.max_running_req == llm.config.max_running_req
    finally:
        llm.shutdown()


def test_a_quantized_copy_of_the_target_drafts_for_it() -> None:
    """The target's own folder as its draft, quantized at load (int8): the draft engine holds
    quantized weights, the target dense ones; its guesses are kept mostly, and the output is
    what decoding without speculation gives."""
    params = [greedy(n) for n in MAX_NEW]
    settings = dict(standalone("qwen3"), speculative_draft_model_quantization="int8")
    spec, plain, llm = speculation_and_plain("qwen3", PROMPTS, params, settings)
    assert token_ids(spec) == token_ids(plain)
    assert llm.speculator.drafter.config.quantization == "int8"
    assert llm.config.quantization is None
    stats = llm.speculator.stats
    assert stats.accepted_tokens >= 0.5 * stats.draft_tokens > 0


def test_num_steps_caps_the_drafts() -> None:
    """--speculative-num-steps: at most that many drafts per request and verify step."""
    llm = draft_llm("qwen3", "qwen3", speculative_num_steps=2)
    try:
        assert llm.speculator.max_drafts == 2
        assert llm.config.speculative_num_draft_tokens == 3
        outputs = run(llm, [REPEATS, [7, 8, 9, 7, 8, 9, 7, 8]], greedy(20))
        stats = llm.speculator.stats
        assert 0 < stats.draft_tokens <= 2 * stats.verify_steps
    finally:
        llm.shutdown()
    assert all(len(o["token_ids"]) == 20 for o in outputs)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(speculative_algorithm="STANDALONE"), "speculative_draft_model_path"),
        (
            dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/d"),
            "speculative_draft_model_path",
        ),
        (dict(speculative_draft_model_path="/d"), "speculative_draft_model_path"),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="/d",
                speculative_draft_model_quantization="int3",
            ),
            "speculative_draft_model_quantization",
        ),
        (
            dict(speculative_algorithm="NGRAM", speculative_draft_model_quantization="int4"),
            "speculative_draft_model_quantization",
        ),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="/d",
                speculative_draft_model_quantization="gguf",
            ),
            "speculative_draft_model_quantization",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "speculative_num_steps"),
        (dict(speculative_num_draft_tokens=1), "speculative_num_draft_tokens"),
        (
            dict(speculative_num_steps=4, speculative_num_draft_tokens=4),
            "speculative_num_steps",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SchedulerConfig(model_path="unused", **settings)


def test_a_draft_of_another_vocabulary_is_refused(tmp_path) -> None:
    """Another vocab_size (before any weight loads), or the same size with another EOS."""
    with pytest.raises(ValueError, match="speculative_draft_model_path.*vocab_size 1000"):
        draft_llm("qwen3", "qwen3-w96")
    # The target's config and tokenizer, its EOS token another one.
    source, other = model_path("qwen3"), tmp_path / "other-eos"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, other / name)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>" if config["eos_token"] != "<|im_start|>" else "<|im_end|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="speculative_draft_model_path.*tokenizer differs"):
        build_llm("qwen3", speculative_algorithm="STANDALONE", speculative_draft_model_path=other)


def test_drafts_between_vocab_sizes_padded_differently() -> None:
    """The same tokenizer in 49,152 and 49,216 rows: accepted both ways. A draft past the
    target's rows ends the drafts; a request holding a token past the draft's rows (here the
    target's, biased to it) drafts nothing; the output is the plain one."""
    for target, draft in (("qwen3", "qwen3-pad"), ("qwen3-pad", "qwen3")):
        padding = 49152 + 7
        params = [greedy(20), greedy(20, logit_bias={padding: 30.0}), greedy(12)]
        prompts = [REPEATS, [7, 8, 9, 7, 8, 9, 7, 8], PROMPTS[0]]
        if target == "qwen3":
            params[1] = greedy(20, logit_bias={9: 5.0})
        spec, plain, llm = spec_and_plain(target, draft, prompts, params)
        assert token_ids(spec) == token_ids(plain)
        if target == "qwen3-pad":
            assert padding in spec[1]["token_ids"]


def test_cli_flags_reach_the_scheduler_config() -> None:
    args = parse_args(
        ["--speculative-algorithm", "standalone", "--speculative-draft-model-path", "/draft"]
        + ["--speculative-num-steps", "3", "--speculative-draft-model-quantization", "int4"]
    )
    kwargs = args.engine_kwargs()
    assert kwargs["speculative_algorithm"] == "STANDALONE"
    assert kwargs["speculative_draft_model_path"] == "/draft"
    assert kwargs["speculative_draft_model_quantization"] == "int4"
    config = SchedulerConfig(model_path="unused", **kwargs)
    assert (config.speculative_num_steps, config.speculative_num_draft_tokens) == (3, 4)
    defaults = SchedulerConfig(model_path="unused", **parse_args([]).engine_kwargs())
    assert (defaults.speculative_num_draft_tokens, defaults.speculative_num_steps) == (8, 7)


class _CountingDrafter:
    """Stands for DraftModelProposer: records the counts it is asked for."""

    def __init__(self, lag: int = 0) -> None:
        self.asked: list[list[int]] = []
        self.step_seconds: list[tuple[int, float]] = []
        self.prefill_seconds: tuple[int, float] | None = None
        self._lag = lag

    def propose(self, reqs: list[Req], counts: list[int]) -> list[list[int]]:
        self.asked.append(counts)
        return [[5] * n for n in counts]

    def lag(self, req: Req) -> int:
        return self._lag


def test_cost_model_counts_draft_model_steps_and_skips_the_run_when_nothing_pays() -> None:
    """Each draft token also costs a draft-model step: drafts while the draft model is cheap
    and guesses good, none (and the draft model not run) where it is dear or guesses poor."""
    from minisgl.scheduler.speculative import Speculator

    def speculator(draft_step: float) -> tuple[Speculator, _CountingDrafter]:
        drafter = _CountingDrafter()
        spec = Speculator(8, 1, 4, 8, 0, drafter=drafter, num_steps=7)  # type: ignore[arg-type]
        for rows in (1, 5, 9):
            for _ in range(5):
                spec.cost.observe(rows, 0.010 + 0.0002 * rows)
                spec.draft_cost.observe(rows, draft_step + 0.0001 * rows)
        return spec, drafter

    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    req = Req(0, ids, greedy(50), prompt_len=3, max_device_len=53, device_len=2)
    cheap, drafter = speculator(0.0005)
    cheap.state(req).acceptance = 0.95
    assert [len(d) for d in cheap.propose([req], [40])] == [7]
    assert drafter.asked == [[7]]
    dear, drafter = speculator(0.02)  # a draft step costs two target steps
    dear.state(req).acceptance = 0.95
    assert dear.propose([req], [40]) == [[]] and drafter.asked == []
    # Not run, its measurements fade: in a while the prior is back and it is tried again.
    assert any(dear.propose([req], [40]) != [[]] for _ in range(600)) and drafter.asked
    poor, drafter = speculator(0.0005)
    poor.state(req).acceptance = 0.01
    assert poor.propose([req], [40]) == [[]] and drafter.asked == []
    # One draft kept half the time for a draft step of 40% of a target step: 6% more tokens a
    # second, expected; within DRAFT_MARGIN, where a draft model's lumpy costs often lose.
    marginal, drafter = speculator(0.004)
    marginal.state(req).acceptance = 0.5
    assert marginal.propose([req], [40]) == [[]] and drafter.asked == []


def test_cost_model_skips_a_long_catch_up_the_tokens_left_cannot_repay() -> None:
    """The draft has no prefix cache: a new request's whole prompt is its first catch-up. It is
    run where drafting the tokens the request has left can save more than it costs."""
    from minisgl.scheduler.speculative import Speculator

    def drafting(max_new: int, catch_up_per_token: float) -> list[int]:
        drafter = _CountingDrafter(lag=1000)
        spec = Speculator(8, 1, 4, 8, 0, drafter=drafter, num_steps=7)  # type: ignore[arg-type]
        for rows in (1, 5):
            spec.cost.observe(rows, 0.010 + 0.0002 * rows)
            spec.draft_cost.observe(rows, 0.0005 + 0.0001 * rows)
        spec.catch_up_seconds.observe(1000, 1000 * catch_up_per_token)
        ids = torch.arange(1, 1001, dtype=torch.int32)
        req = Req(0, ids, greedy(max_new), prompt_len=1000, max_device_len=1000 + max_new)
        req.device_len = 999
        spec.state(req).acceptance = 0.9
        return [len(d) for d in spec.propose([req], [max_new])]

    # 1,000 tokens at 1 ms: a second, where 32 tokens can save at most 32 steps of 10 ms
    assert drafting(32, 0.001) == [0]
    assert drafting(2000, 0.001)[0] > 0  # 2,000 tokens can repay it
    assert drafting(32, 0.00001)[0] > 0  # a cheap draft model's catch-up: 10 ms
