"""Structured output (xgrammar): every completion of the default model sampled at temperature 1
parses and validates against its JSON schema, regex and choice constraints hold, and the
OpenAI / vLLM request fields reach the engine over HTTP (bad constraints: a 400 naming them)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
import torch
from helpers import assert_all_pages_free, build_llm
from structured_schemas import SCHEMAS
from test_server import wait_healthy

from minisgl.core import Req, RequestError, SamplingParams, StructuredOutput
from minisgl.scheduler import grammar
from minisgl.scheduler.grammar import CompileBusy, CompilePool, CompileTimeout


@pytest.fixture(scope="module")
def server(tiny_qwen3_server):
    """The session's server on the tiny float32 Qwen3 (prefill in chunks of 16; conftest.py)."""
    return wait_healthy(tiny_qwen3_server)


def constrained(kind: str, spec: str, seed: int, max_tokens: int = 256) -> SamplingParams:
    structured = StructuredOutput(kind, spec)
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, structured=structured)


def test_json_schemas_regexes_and_choices_hold_at_temperature_one() -> None:
    torch.set_num_threads(2)
    llm = build_llm("smollm2", dtype=torch.bfloat16)
    prompts = [f"Reply with JSON for example {i}:" for i in range(len(SCHEMAS))]
    params = [constrained("json", json.dumps(s), seed=i) for i, s in enumerate(SCHEMAS)]
    for schema, out in zip(SCHEMAS, llm.generate(prompts, params)):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    # Any JSON object (json_object), regexes and choices.
    regexes = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{2,8}"]
    choices = ["Paris", "London", "Rome"]
    # Any object: unbounded strings at temperature 1 can run past any max_tokens; greedy here.
    params = [SamplingParams(max_tokens=256, structured=StructuredOutput("json"))]
    params += [constrained("regex", r, seed=i) for i, r in enumerate(regexes)]
    params += [constrained("choice", json.dumps(choices), seed=i) for i in range(3)]
    outs = llm.generate(["Describe a cat in JSON:"] * len(params), params)
    assert isinstance(json.loads(outs[0]["text"]), dict)
    for regex, out in zip(regexes, outs[1:]):
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])
    assert all(o["text"] in choices for o in outs[1 + len(regexes) :])
    assert_all_pages_free(llm)
    llm.shutdown()


def test_length_bounded_json_strings_take_escapes_and_refuse_raw_control_characters() -> None:
    """xgrammar lowers a string with minLength / maxLength to a run that admitted raw control
    characters (invalid JSON: a raw tab) and no escape (mlc-ai/xgrammar#800): the grammar
    minisgl compiles takes JSON's characters there, an escape counting as one."""
    import xgrammar as xgr

    schema = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}}
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[256]), max_threads=1)
    compiled = compiler.compile_grammar(grammar.json_schema_grammar(json.dumps(schema)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(256)

    valid = ['["abc"]', '["a\\"b", "\\n"]', '["\\u00e9\\t!"]', '["日本語"]']
    for text in valid:
        assert accepts(text), text
        assert all(1 <= len(item) <= 3 for item in json.loads(text)), text
    for text in ['["a\tb"]', '["\x01"]', '["abcd"]', '[""]', '["\\x"]']:
        assert not accepts(text), text


def test_openai_and_vllm_fields_over_http(client, model) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "A number, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=64, response_format=fmt, stream=stream
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            if stream
            else reply.choices[0].message.content
        )
        jsonschema.validate(json.loads(text), schema)
    kw = dict(model=model, prompt="Pick:", max_tokens=32, temperature=1.0)
    for extra, check in [
        ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_json": schema}, lambda t: json.loads(t)["n"] in range(100)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ]:
        text = client.completions.create(**kw, extra_body=extra).choices[0].text
        assert check(text), (extra, text)
    # Any object: this random-weight model's free keys may outrun max_tokens; what it finishes
    # parses.
    choice = client.completions.create(
        **kw, extra_body={"response_format": {"type": "json_object"}}
    ).choices[0]
    assert choice.text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)


def test_reasoning_parser_splits_thinking_from_content(client, model) -> None:
    """--reasoning-parser qwen3 (the shared server's): an output opening with <think> (here held
    to it by a regex) comes back as reasoning_content and content, streamed as their own
    deltas; separate_reasoning false keeps it whole; a thinking-free output is content alone."""
    think = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){0,3}\n</think>\n\n[A-Z][a-z]{2,8}"
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=48,
        temperature=0.0,
    )
    message = client.chat.completions.create(**kw, extra_body={"guided_regex": think})
    reasoning = message.choices[0].message.model_extra["reasoning_content"]
    content = message.choices[0].message.content
    assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){0,3}\n", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", content), content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(
        **kw, stream=True, extra_body={"guided_regex": think}
    ):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get(
                "reasoning_content"
            ) or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}
    whole = (
        client.chat.completions.create(
            **kw, extra_body={"guided_regex": think, "separate_reasoning": False}
        )
        .choices[0]
        .message
    )
    assert whole.content == f"<think>\n{reasoning}</think>\n\n{content}"
    plain = client.chat.completions.create(**kw, extra_body={"guided_regex": "[A-Z][a-z]{2,8}"})
    assert plain.choices[0].message.model_extra["reasoning_content"] is None
    assert re.fullmatch("[A-Z][a-z]{2,8}", plain.choices[0].message.content)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_json": {"type": "nonsense-type"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(server, model, body, param) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": "x", "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sglang_generate_constraints(server) -> None:
    for params, check in [
        ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"json_schema": json.dumps({"enum": ["a", "b"]})}, lambda t: json.loads(t) in "ab"),
    ]:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 16, **params}}
        text = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["text"]
        assert check(text), (params, text)


def test_compile_pool_replaces_stuck_compiles_up_to_a_bound() -> None:
    """A compile past the limit fails its job alone and a fresh thread takes its place, so later
    compiles never queue behind it; at most workers + max_stuck threads exist, and with every
    one held by a stuck compile, queued jobs and new submissions fail (CompileBusy) rather than
    wait. (Deterministic: "hang" compiles block on an event; the server-side test is
    test_server_lifecycle.py's.)"""
    release, started = threading.Event(), threading.Semaphore(0)

    def compile(spec: str) -> str:
        if spec == "hang":
            started.release()
            release.wait(30)
        if spec == "bad":
            raise ValueError("bad spec")
        return spec.upper()

    def expire_after(limit_s: float) -> None:
        time.sleep(limit_s + 0.05)
        pool.expire()

    pool = CompilePool(compile, timeout_s=0.2, workers=2, max_stuck=2)
    try:
        assert pool.threads == 2
        hang = pool.submit("hang")
        assert started.acquire(timeout=10)
        assert pool.submit("a").result(10) == "A"  # the other thread, while one hangs
        with pytest.raises(ValueError, match="bad spec"):
            pool.submit("bad").result(10)
        expire_after(0.2)
        with pytest.raises(CompileTimeout):
            hang.result(0)
        assert (pool.stuck, pool.threads) == (1, 3)  # replaced: two healthy threads again
        assert pool.submit("b").result(10) == "B"
        hang = pool.submit("hang")
        assert started.acquire(timeout=10)
        expire_after(0.2)
        assert (pool.stuck, pool.threads) == (2, 4)
        # At the bound (max_stuck = 2): refused at once, nothing queued behind the stuck ones.
        with pytest.raises(CompileBusy):
            pool.submit("c")
        release.set()  # the stuck compiles return: their threads end, submissions work again
        wait_until(lambda: pool.stuck == 0)
        assert pool.threads == 2
        assert pool.submit("d").result(10) == "D"

        # Every thread held by a stuck compile: the job queued behind them fails, not waits.
        release.clear()
        hangs = [pool.submit("hang") for _ in range(4)]
        queued = pool.submit("e")
        for _ in range(2):
            assert started.acquire(timeout=10)
        expire_after(0.2)  # two stuck; two fresh threads take the other two hangs
        for _ in range(2):
            assert started.acquire(timeout=10)
        expire_after(0.2)  # four stuck = workers + max_stuck threads: none left for "e"
        assert (pool.stuck, pool.threads) == (4, 4)
        with pytest.raises(CompileBusy):
            queued.result(0)
        for future in hangs:
            with pytest.raises(CompileTimeout):
                future.result(0)
        release.set()
        wait_until(lambda: pool.stuck == 0)
        assert pool.submit("f").result(10) == "F"
    finally:
        release.set()
        pool.close()
    wait_until(lambda: pool.threads == 0)  # closed: every thread ends


def test_grammar_queue_reports_a_timeout_then_refuses_when_busy() -> None:
    """What the scheduler gets: a timed-out compile fails its request (code
    grammar_compile_timeout, the flag and its value in the message: a 400), and at the bound a
    new constrained request is refused (RequestError, code server_busy: a 503)."""
    from helpers import tiny_model

    from minisgl.tokenizer import load_tokenizer

    release = threading.Event()
    queue = grammar.GrammarQueue(load_tokenizer(str(tiny_model("qwen3"))), 49152, 0.1)
    queue.close()
    queue._pool = CompilePool(lambda spec: release.wait(30), 0.1, workers=1, max_stuck=1)

    def req(uid: int) -> Req:
        sp = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[0-9]"))
        return Req(uid, torch.tensor([1, 2]), sp, prompt_len=2, max_device_len=6)

    try:
        queue.add(req(0))
        time.sleep(0.2)
        compiled, failed = queue.ready()
        assert compiled == [] and [(r.uid, code) for r, _, code in failed] == [
            (0, grammar.TIMEOUT_CODE)
        ]
        assert "--grammar-compile-timeout=0.1s" in failed[0][1], failed
        assert queue.pending == {}
        with pytest.raises(RequestError) as refused:
            queue.add(req(1))
        assert refused.value.code == grammar.BUSY_CODE and refused.value.param == "structured"
        assert "--grammar-compile-timeout=0.1s" in str(refused.value)
    finally:
        release.set()
        queue.close()


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_compile_pool_without_a_limit_never_gives_up() -> None:
    pool = CompilePool(lambda spec: time.sleep(0.3) or spec, timeout_s=0)
    try:
        future = pool.submit("x")
        time.sleep(0.35)
        pool.expire()
        assert future.result(10) == "x" and pool.stuck == 0
    finally:
        pool.close()


def test_a_constraint_text_cannot_finish_fails_naming_itself_not_the_model() -> None:
    """A grammar that takes "ab" and then no character at all masks every logit of the step
    after it: that request fails saying its constraint cannot be completed (a 400 naming
    `structured` over HTTP), the others in its batch run on."""
    torch.set_num_threads(2)
    llm = build_llm("qwen3")
    dead_end = StructuredOutput("grammar", 'root ::= "ab" [^\\x00-\\U0010ffff]')
    params = [SamplingParams(max_tokens=8, structured=dead_end), SamplingParams(max_tokens=4)]
    failed, other = llm.generate(["Hi", "Hello"], params)
    assert failed["finish_reason"] == "error" and failed["text"] == "ab"
    assert "constraint allows no token" in failed["error"], failed["error"]
    assert other["finish_reason"] == "length" and len(other["token_ids"]) == 4
    assert_all_pages_free(llm)
    llm.shutdown()
