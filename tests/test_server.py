"""The OpenAI-compatible server, end to end: a real `python -m minisgl` on a free port,
driven with the official `openai` client (and raw HTTP where the client would refuse).

One server per module (startup costs seconds): the default model in float32, so that greedy
text can be compared with the offline `LLM` on the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from helpers import PROMPTS, build_llm, greedy, smollm2
from prometheus_client.parser import text_string_to_metric_families

from minisgl.tokenizer import encode_chat

API_KEY = "test-key"
MAX_TOKENS = 12
# The offline reference uses the same engine settings as the server below (build_llm's).
SERVER_ARGS = ["--dtype", "float32", "--num-pages", "4096", "--max-seq-len", "512"]
STREAM_PROMPTS = [*PROMPTS, "Hello, my name is", "1, 2, 3, 4, 5,", "Write a haiku about the sea."]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
]
STOP_PROMPT = "The three primary colors are"


# ---------------------------------------------------------------- server process helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def spawn_server(
    model: Path, args: list[str], log: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    """Launch `python -m minisgl` in its own session (process group); do not wait."""
    port = free_port()
    threads = str(min(2, os.cpu_count() or 1))
    env = {**os.environ, "MINISGL_NUM_THREADS": threads, **(env or {})}
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model), "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(server: ServerProcess, timeout: float = 300.0) -> ServerProcess:
    """Wait until /health answers; fail early (with the log) if the server exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not start in {timeout}s:\n{server.log_text()}")


def start_server(
    model: Path, args: list[str], log: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    return wait_healthy(spawn_server(model, args, log, env))


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name{labels}."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def started(smollm2_server):
    """The server (the session's, conftest.py: test_server_native.py uses it too), and the
    offline greedy outputs (the oracle) computed while it starts."""
    llm = build_llm("smollm2")
    tok = llm.tokenizer
    out = {}
    texts = llm.generate(STREAM_PROMPTS, greedy(MAX_TOKENS))
    out.update({p: o["text"] for p, o in zip(STREAM_PROMPTS, texts)})
    chat_ids = [encode_chat(tok, msgs) for msgs in CHATS]
    for i, o in enumerate(llm.generate(chat_ids, greedy(MAX_TOKENS))):
        out[f"chat{i}"] = o["text"]
    # No max_tokens: up to the end of the context (the model's EOS comes well before).
    out["chat_unbounded"] = llm.generate(chat_ids[:1], greedy(None))[0]
    out["stop"] = llm.generate([STOP_PROMPT], greedy(32))[0]["text"]
    llm.shutdown()
    del llm
    return wait_healthy(smollm2_server), out


@pytest.fixture(scope="module")
def server(started):
    return started[0]


@pytest.fixture(scope="module")
def expected(started):
    return started[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# ---------------------------------------------------------------- tests
def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    assert models[0].model_extra["max_model_len"] == 512  # --max-seq-len


def test_completions_greedy_matches_offline(client, model, expected):
    resp = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == [expected[p] for p in PROMPTS]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions_token_ids_prompt(client, model, expected):
    from minisgl.tokenizer import load_tokenizer

    ids = load_tokenizer(smollm2())(PROMPTS[0]).input_ids
    resp = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == expected[PROMPTS[0]]
    assert resp.usage.prompt_tokens == len(ids)


def test_chat_greedy_matches_offline_streaming_and_not(client, model, expected):
    for i, messages in enumerate(CHATS):
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == expected[f"chat{i}"]
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected[f"chat{i}"]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert (
            reasons[-1] == resp.choices[0].finish_reason and reasons.count(None) == len(reasons) - 1
        )
        assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_without_max_tokens_runs_to_the_end(client, model, expected):
    """OpenAI clients often omit max_tokens: the room the context leaves, never a 400."""
    resp = client.chat.completions.create(model=model, messages=CHATS[0], temperature=0)
    want = expected["chat_unbounded"]
    assert want["finish_reason"] == "stop"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == want["text"]
    assert resp.usage.completion_tokens == len(want["token_ids"])


def test_chat_content_parts_and_n(client, model, expected):
    parts = [
        {"type": "text", "text": "What is the capital "},
        {"type": "text", "text": "of France?"},
    ]
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content == expected["chat0"] for c in resp.choices)


def test_eight_concurrent_streams(server, model, expected):
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str]]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        pieces = [c.choices[0].text async for c in stream]
        return "".join(pieces), pieces

    async def run() -> list[tuple[str, list[str]]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in STREAM_PROMPTS))

    results = asyncio.run(run())
    assert len(STREAM_PROMPTS) == 8
    for prompt, (text, pieces) in zip(STREAM_PROMPTS, results):
        assert text == expected[prompt], prompt
        assert all("\ufffd" not in p for p in pieces)
        assert len(pieces) > 1  # really streamed, not one blob


def test_serving_benchmark_client_records_every_token(server, model, expected):
    """benchmark/serving.py's client: streamed text equals the greedy output, every token
    counted, chunk times in order (it parses the raw events only after the run)."""
    from minisgl.tokenizer import load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    import serving

    tokenizer = load_tokenizer(smollm2())
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:2]]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    results, wall = asyncio.run(
        serving.run_load(server.url, model, prompts, MAX_TOKENS, [0.0, 0.05], 1, headers)
    )
    assert len(results) == 2 and wall > 0
    for prompt, result in zip(PROMPTS, results):
        assert result.ok, result.error
        assert result.output_tokens == MAX_TOKENS and result.prompt_len > 0
        # ignore_eos: the stream may run past where the offline greedy run met EOS.
        assert "".join(result.chunk_texts).startswith(expected[prompt])
        assert result.chunk_times == sorted(result.chunk_times)
        assert result.ttft == result.chunk_times[0] <= result.e2e
        assert result.tpot is not None and result.tpot > 0
    # Concurrency 1: the second request was sent only after the first one ended.
    assert results[1].sent >= results[0].sent + results[0].e2e
    summary = serving.summarize(results, wall, tokenizer)
    assert summary.completed == 2 and summary.failed == 0
    assert summary.output_tokens == 2 * MAX_TOKENS
    assert len(summary.samples_ms["ITL"]) == 2 * (MAX_TOKENS - 1)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_and_never_leak(client, model, expected, stream):
    full = expected["stop"]
    # A multi-token stop string from the middle of the greedy output.
    start = len(full) // 3
    stop = full[start : start + 6]
    want = full[: full.find(stop)]
    kwargs = dict(model=model, prompt=STOP_PROMPT, max_tokens=32, temperature=0, stop=[stop, "@@"])
    if stream:
        pieces = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in pieces)
        assert pieces[-1].choices[0].finish_reason == "stop"
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text = choice.text
        assert choice.finish_reason == "stop"
    assert text == want
    assert stop not in text


def test_min_tokens_holds_off_stop_strings(client, model, expected):
    full = expected["stop"]
    stop = full[len(full) // 3 :][:6]
    choice = client.completions.create(
        model=model,
        prompt=STOP_PROMPT,
        max_tokens=32,
        temperature=0,
        stop=[stop],
        extra_body={"min_tokens": 32},
    ).choices[0]
    assert choice.text == full and choice.finish_reason == "length"


def test_stop_token_ids_and_ignore_eos(client, model):
    resp = client.completions.create(
        model=model,
        prompt="1, 2, 3, 4, 5,",
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [28], "ignore_eos": True},  # 28 = ","
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 20


def test_sampling_parameters_are_accepted(client, model):
    request = dict(
        model=model,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    resp = client.completions.create(**request)
    again = client.completions.create(**request)
    assert resp.choices[0].text == again.choices[0].text  # seeded sampling is reproducible


@dataclass(frozen=True)
class BadRequest:
    """A malformed request and the error it must get."""

    endpoint: str  # under /v1
    body: bytes
    param: str | None
    code: str | None
    status: int = 400
    at_edge: bool = True  # refused by the API server itself, before the tokenizer


def _cmpl(**fields) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


def _chat(content="hi", **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def _bad(endpoint: str, body: bytes, param: str | None, code: str | None, **kw) -> BadRequest:
    return BadRequest(
        "chat/completions" if endpoint == "chat" else endpoint, body, param, code, **kw
    )


LONG = "hello " * 600  # ~600 tokens: over the 512-token context
BAD_REQUESTS = [
    # Bad JSON, or JSON that is not an object.
    _bad("completions", b"{not json", None, "invalid_json"),
    _bad("completions", b"", None, "invalid_json"),
    _bad("completions", b'{"prompt": "\xff\xfe"}', None, "invalid_json"),  # not UTF-8
    _bad("completions", b'{"prompt": "\\ud800"}', None, "invalid_json"),  # lone surrogate
    _bad("completions", b"[1, 2]", None, "invalid_type"),
    _bad("chat", b'"hi"', None, "invalid_type"),
    # Missing or wrongly typed parameters.
    _bad("completions", b'{"max_tokens": 4}', "prompt", "missing_required_parameter"),
    _bad("chat", b'{"max_tokens": 4}', "messages", "missing_required_parameter"),
    _bad("chat", b'{"messages": "hi"}', "messages", "invalid_type"),
    _bad("completions", _cmpl(max_tokens="4"), "max_tokens", "invalid_type"),
    _bad("completions", _cmpl(max_tokens=1.5), "max_tokens", "invalid_type"),
    _bad("completions", _cmpl(seed=1.0), "seed", "invalid_type"),
    _bad("completions", _cmpl(temperature="hot"), "temperature", "invalid_type"),
    _bad("completions", _cmpl(stream="yes"), "stream", "invalid_type"),
    _bad("completions", _cmpl(ignore_eos="true"), "ignore_eos", "invalid_type"),
    _bad(
        "completions", _cmpl(stream_options={"include_usage": 1}), "stream_options", "invalid_type"
    ),
    _bad("completions", _cmpl(model=5), "model", "invalid_type"),
    _bad("completions", _cmpl(stop=5), "stop", "invalid_type"),
    _bad("completions", json.dumps({"prompt": 3.5}).encode(), "prompt", "invalid_type"),
    _bad(
        "chat",
        json.dumps({"messages": [{"role": 5, "content": "hi"}]}).encode(),
        "messages",
        "invalid_value",
    ),
    _bad(
        "chat",
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        "messages",
        "invalid_value",
    ),
    _bad("chat", _chat(5), "messages", "invalid_type"),
    _bad(
        "chat",
        _chat([{"type": "image_url", "image_url": {"url": "x"}}]),
        "messages",
        "invalid_value",
    ),
    _bad("chat", b'{"messages": []}', "messages", "invalid_value"),
    # Integers beyond 64 bits or beyond what the field can mean.
    _bad("completions", _cmpl(max_tokens=2**64), "max_tokens", "context_length_exceeded"),
    _bad("completions", _cmpl(max_tokens=10**9), "max_tokens", "context_length_exceeded"),
    _bad(
        "chat", _chat(max_completion_tokens=513), "max_completion_tokens", "context_length_exceeded"
    ),
    _bad("completions", _cmpl(max_tokens=0), "max_tokens", "invalid_value"),
    _bad("chat", _chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
    _bad("completions", _cmpl(seed=2**70), "seed", "invalid_value"),
    _bad("completions", _cmpl(seed=-(2**63) - 1), "seed", "invalid_value"),
    _bad("completions", _cmpl(n=0), "n", "invalid_value"),
    _bad("completions", _cmpl(n=65), "n", "invalid_value"),
    _bad("completions", _cmpl(top_k=2**31), "top_k", "invalid_value"),
    _bad("completions", _cmpl(top_k=-2), "top_k", "invalid_value"),
    _bad("completions", _cmpl(stop_token_ids=[-1]), "stop_token_ids", "invalid_value"),
    _bad("completions", _cmpl(stop_token_ids=[2**64]), "stop_token_ids", "invalid_value"),
    _bad("completions", _cmpl(stop_token_ids=[1] * 257), "stop_token_ids", "invalid_value"),
    _bad("completions", _cmpl(prompt=[1, 2**64]), "prompt", "invalid_value"),
    _bad("completions", _cmpl(prompt=[[5], [-1]]), "prompt", "invalid_value"),
    _bad("completions", _cmpl(prompt=[]), "prompt", "invalid_value"),
    # Floats out of range or not finite (JSON's 1e999 is infinity).
    _bad("completions", b'{"prompt": "hi", "temperature": 1e999}', "temperature", "invalid_value"),
    _bad("completions", b'{"prompt": "hi", "top_p": NaN}', "top_p", "invalid_value"),
    _bad(
        "completions",
        b'{"prompt": "hi", "presence_penalty": -Infinity}',
        "presence_penalty",
        "invalid_value",
    ),
    _bad("completions", _cmpl(temperature=-1), "temperature", "invalid_value"),
    _bad("completions", _cmpl(top_p=0), "top_p", "invalid_value"),
    _bad("completions", _cmpl(min_p=1.5), "min_p", "invalid_value"),
    _bad("completions", _cmpl(frequency_penalty=2.5), "frequency_penalty", "invalid_value"),
    _bad("completions", _cmpl(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    # Stop lists too long, empty stop strings.
    _bad("completions", _cmpl(stop=[str(i) for i in range(17)]), "stop", "invalid_value"),
    _bad("completions", _cmpl(stop="x" * 257), "stop", "invalid_value"),
    _bad("completions", _cmpl(stop=[""]), "stop", "invalid_value"),
    # Log-probabilities beyond 20 alternatives, top_logprobs without logprobs.
    _bad("completions", _cmpl(logprobs=21), "logprobs", "invalid_value"),
    _bad("completions", _cmpl(logprobs=-1), "logprobs", "invalid_value"),
    _bad("completions", _cmpl(prompt_logprobs=21), "prompt_logprobs", "invalid_value"),
    _bad("chat", _chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    _bad("chat", _chat(top_logprobs=2), "top_logprobs", "invalid_value"),
    _bad("chat", _chat(logprobs="yes"), "logprobs", "invalid_type"),
    # Unknown model, unsupported parameters.
    _bad("completions", _cmpl(model="gpt-9"), "model", "model_not_found", status=404),
    _bad("chat", _chat(tools=[{"type": "function", "function": {}}]), "tools", "invalid_value"),
    _bad("chat", _chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    # Refused by the scheduler: over-context prompts, prompt + max_tokens past the context,
    # token ids outside the vocabulary.
    _bad("completions", _cmpl(prompt=LONG), "prompt", "context_length_exceeded", at_edge=False),
    _bad("chat", _chat(LONG), "messages", "context_length_exceeded", at_edge=False),
    _bad(
        "completions",
        _cmpl(prompt=LONG[:600], max_tokens=500),
        "max_tokens",
        "context_length_exceeded",
        at_edge=False,
    ),
    _bad(
        "chat",
        _chat(LONG[:600], max_completion_tokens=500),
        "max_completion_tokens",
        "context_length_exceeded",
        at_edge=False,
    ),
    _bad("completions", _cmpl(prompt=[99999999]), "prompt", "invalid_value", at_edge=False),
]


def test_bad_input_gets_openai_error_then_server_still_serves(server, model):
    """Every malformed request: a 4xx OpenAI error naming the parameter, then a good request
    succeeds; nothing of it in the log as a traceback."""
    log_start = len(server.log_text())
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    good = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=f"{server.url}/v1", headers=headers, timeout=60) as http:
        for case in BAD_REQUESTS:
            r = http.post(case.endpoint, content=case.body)
            assert r.status_code == case.status, (case, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], case
            assert (error["param"], error["code"]) == (case.param, case.code), (case, error)
            assert error["type"] == "invalid_request_error", case
            ok = http.post("completions", json=good)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, case
    assert "Traceback" not in server.log_text()[log_start:]


def test_openai_client_sees_errors_as_exceptions(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_api_key_is_required(server):
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(server, stream):
    before = metrics(server.url)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    if stream:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = 0
                for line in r.iter_lines():
                    lines += bool(line)
                    if lines == 3:
                        break  # leaving the block closes the connection mid-stream
    else:
        # A non-streaming client that gives up (times out) while the text is generated.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=2.0)

    def settled():
        m = metrics(server.url)
        done = (
            m["minisgl_aborted_requests_total"] == before["minisgl_aborted_requests_total"] + 1
            and m["minisgl_num_requests_running"] == 0
            and m["minisgl_num_requests_waiting"] == 0
        )
        return m if done else None

    m = wait_for(settled, what="the aborted request to be gone")
    pages = wait_for(
        lambda: (mm := metrics(server.url))["minisgl_page_accounting_ok"] == 1 and mm,
        what="page accounting",
    )
    assert (
        pages["minisgl_kv_pages{state=free}"] + pages["minisgl_kv_pages{state=cached}"]
        == pages["minisgl_kv_pages{state=total}"]
    )
    assert m["minisgl_requests_total{finish_reason=abort}"] >= 1
    assert "client disconnected" in server.log_text()
    # The generation stopped early: far fewer than 400 tokens were produced.
    generated = m["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    assert generated < 400


def test_multi_turn_chat_reuses_the_cache(client, model):
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Hi! Who are you?"},
    ]
    cached = []
    for question in ["What is 2 + 2?", "And what is 3 + 3?", "Thanks. Goodbye!"]:
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < resp.usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": question},
        ]
    assert cached[0] < cached[1] < cached[2], cached


def test_metrics_parse_and_move_with_traffic(server, client, model):
    before = metrics(server.url)
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0)

    def moved():
        m = metrics(server.url)
        key = "minisgl_cached_prompt_tokens_total"
        return m if m[key] > before[key] else None

    after = wait_for(moved, what="counters")
    for name in [
        "minisgl_prompt_tokens_total",
        "minisgl_generation_tokens_total",
        "minisgl_time_to_first_token_seconds_count",
        "minisgl_e2e_request_latency_seconds_count",
    ]:
        assert after[name] > before[name], name
    assert (
        after["minisgl_inter_token_latency_seconds_count"]
        >= before["minisgl_inter_token_latency_seconds_count"] + 3
    )
    for gauge in [
        "minisgl_num_requests_running",
        "minisgl_num_requests_waiting",
        "minisgl_kv_cache_usage_ratio",
        "minisgl_prefix_cache_hit_rate",
    ]:
        assert gauge in after
    assert (
        after["minisgl_cached_prompt_tokens_total"] > before["minisgl_cached_prompt_tokens_total"]
    )
    assert 0 < after["minisgl_prefix_cache_hit_rate"] <= 1


@pytest.mark.stops_shared_server
def test_zz_shutdown_leaves_no_child_process(smollm2_server):
    """Runs last in the session (it stops the session's server, conftest.py): SIGTERM to the
    whole process group (as systemd or `kill -- -PGID` send it) is a clean shutdown, not a
    worker failure, and leaves no process behind. (The launcher stopping live children itself
    is covered by test_server_lifecycle.py, where the scheduler is killed.)"""
    server = wait_healthy(smollm2_server)
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert len(children) >= 3  # scheduler, tokenizer, detokenizer
    os.killpg(server.proc.pid, signal.SIGTERM)  # the server leads its own session
    assert server.proc.wait(30) == 0, server.log_text()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.pid for p in alive]
    log = server.log_text()
    assert "all server processes stopped" in log and "died" not in log
