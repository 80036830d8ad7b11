"""The API server's edge, in process and without a model: malformed requests are refused with
an OpenAI error body and leave nothing behind; the pipeline's errors map to the right HTTP
answer (400 rejected, 500 this request failed, 503 the server is going down).

A fake pipeline thread stands in for tokenizer, scheduler and detokenizer: it answers each
request by the marker in its prompt.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq
from fastapi.testclient import TestClient
from test_server import BAD_REQUESTS

from minisgl.message import AcceptedMsg, ErrorMsg, OutputMsg, TokenizeMsg
from minisgl.message.queue import ZmqAddresses, ZmqPullQueue, ZmqPushQueue
from minisgl.server.api_server import ServerState, create_app
from minisgl.server.frontend import FrontendManager
from minisgl.server.metrics import ServerMetrics

MAX_MODEL_LEN = 512  # as the real server of test_server.py
VOCAB = 49152  # SmolLM2's


class FakePipeline(threading.Thread):
    """Answers TokenizeMsgs by their prompt: "reject" -> an ErrorMsg before acceptance (an
    over-context prompt), "busy" -> a server_busy one (grammar compiles stuck past their time
    limit), "fail" -> accepted, one piece of text, then a request_failed error,
    "hang" -> accepted and nothing more, anything else -> accepted, "ok", finished."""

    def __init__(self, addrs: ZmqAddresses) -> None:
        super().__init__(daemon=True)
        self.inbox = ZmqPullQueue(addrs.tokenizer)
        self.outbox = ZmqPushQueue(addrs.api_server)
        self.received: list = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.inbox.socket.poll(50, zmq.POLLIN):
                continue
            for msg in self.inbox.get():
                with self.lock:
                    self.received.append(msg)
                if isinstance(msg, TokenizeMsg):
                    self.outbox.put_many(self.answer(msg))

    @staticmethod
    def answer(msg: TokenizeMsg) -> list:
        if msg.text is not None:
            prompt = msg.text
        else:  # token ids (health_generate's) are an ordinary prompt
            prompt = msg.messages[-1]["content"] if msg.messages else "ids"
        if "reject" in prompt:
            return [
                ErrorMsg(msg.rid, "the prompt has 600 tokens", "prompt", "context_length_exceeded")
            ]
        if "busy" in prompt:
            return [ErrorMsg(msg.rid, "compiles are stuck", "structured", "server_busy")]
        accepted = AcceptedMsg(msg.rid, 3)
        if "fail" in prompt:
            return [
                accepted,
                OutputMsg(msg.rid, "par", 1),
                ErrorMsg(msg.rid, "boom", None, "request_failed"),
            ]
        if "hang" in prompt:
            return [accepted]
        return [accepted, OutputMsg(msg.rid, "ok", 1, "length", completion_tokens=1)]

    def take_received(self) -> list:
        with self.lock:
            out, self.received = self.received, []
        return out


@dataclass
class App:
    http: TestClient
    frontend: FrontendManager
    pipeline: FakePipeline


@pytest.fixture
def app(tmp_path) -> Iterator[App]:
    addrs = ZmqAddresses(str(tmp_path))
    pipeline = FakePipeline(addrs)
    pipeline.start()
    metrics = ServerMetrics()
    frontend = FrontendManager(addrs, metrics)
    state = ServerState("m", "/models/m", MAX_MODEL_LEN, frontend, metrics, vocab_size=VOCAB)
    try:
        with TestClient(create_app(state)) as http:
            yield App(http, frontend, pipeline)
    finally:
        pipeline.stopping.set()
        pipeline.join()


def completion(app: App, prompt: str, **kw) -> dict:
    r = app.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **kw})
    return {"status": r.status_code, **r.json()}


def events(app: App, path: str, body: dict) -> list:
    """The SSE events of a streamed request, parsed ([DONE] as the string)."""
    with app.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [x if x == "[DONE]" else json.loads(x) for x in (line[6:] for line in lines)]


def test_refused_requests_leave_nothing_behind(app):
    refused_here = [case for case in BAD_REQUESTS if case.at_edge]
    assert len(refused_here) >= 30
    for case in refused_here:
        headers = {"Content-Type": "application/json"}
        r = app.http.post(f"/v1/{case.endpoint}", content=case.body, headers=headers)
        assert r.status_code == case.status, (case, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], case
        assert (error["param"], error["code"]) == (case.param, case.code), (case, error)
        assert app.frontend._tracked == {}, case
    # Nothing went to the tokenizer; the next good request is served.
    assert completion(app, "hello")["choices"][0]["text"] == "ok"
    assert [type(m) for m in app.pipeline.take_received()] == [TokenizeMsg]
    assert app.frontend._tracked == {}


def test_pipeline_errors_map_to_http_answers(app):
    # Rejected by the scheduler: 400 naming the endpoint's parameter, nothing left tracked.
    body = completion(app, "reject")
    assert body["status"] == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": "reject"}], "max_completion_tokens": 4}
    r = app.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # Refused for now (too many grammar compiles past their limit): 503, try again later.
    body = completion(app, "busy")
    assert body["status"] == 503, body
    assert (body["error"]["code"], body["error"]["type"]) == ("server_busy", "server_error")
    # Failed after acceptance: 500 server_error, or in a stream an error event then [DONE].
    body = completion(app, "fail")
    assert body["status"] == 500, body
    assert body["error"] == {
        "message": "boom",
        "type": "server_error",
        "param": None,
        "code": "request_failed",
    }
    streamed = events(app, "/v1/completions", {"prompt": "fail", "max_tokens": 4})
    assert streamed[0]["choices"][0]["text"] == "par"
    assert streamed[-2] == {"error": body["error"]} and streamed[-1] == "[DONE]"
    # n = 3 samples of which every one fails: the siblings still running are aborted.
    assert completion(app, "fail", n=3)["status"] == 500
    assert app.frontend._tracked == {}
    assert completion(app, "fine")["choices"][0]["text"] == "ok"


def test_engine_failure_ends_open_requests_and_health(app):
    """What the launcher's monitor does when a worker dies: every open request gets a
    server_error, /health and new requests answer 503."""
    accepted = threading.Event()
    lines: list[str] = []

    def open_stream() -> None:
        chat = {"messages": [{"role": "user", "content": "hang"}], "stream": True}
        with app.http.stream("POST", "/v1/chat/completions", json=chat) as r:
            for line in r.iter_lines():
                lines.append(line)
                accepted.set()  # the role chunk comes once the request was accepted

    waiter = threading.Thread(target=open_stream)
    waiter.start()
    assert accepted.wait(30)
    app.frontend.fail_all_threadsafe("the scheduler process died")
    waiter.join(30)
    assert not waiter.is_alive()
    data = [json.loads(x[6:]) if x != "data: [DONE]" else x for x in lines if x]
    error = data[-2]["error"]
    assert error["type"] == "server_error" and "scheduler process died" in error["message"]
    assert data[-1] == "data: [DONE]"
    assert app.http.get("/health").status_code == 503
    body = completion(app, "hello")
    assert body["status"] == 503 and body["error"]["type"] == "server_error"


CHAT = [{"role": "user", "content": "hi"}]
BAD_SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
NAMED_F = {"type": "function", "function": {"name": "f"}}
# vLLM's extensions and the native endpoints: refused by the API server itself, naming the
# parameter (test_server_native.py has the ones the scheduler refuses).
REFUSED = [
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [3, VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    (
        "/v1/completions",
        {"prompt": "x", "spaces_between_special_tokens": 0},
        "spaces_between_special_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "include_stop_str_in_output": 1},
        "include_stop_str_in_output",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"continuous_usage_stats": "y"}},
        "stream_options",
    ),
    ("/v1/completions", {"prompt": "x", "user": 5}, "user"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "continue_final_message": True},
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "add_generation_prompt": 1},
        "add_generation_prompt",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": 3}, "chat_template_kwargs"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "min_tokens": 9, "max_completion_tokens": 2},
        "min_tokens",
    ),
    # A tool that is not an object (an AttributeError, a 500, before).
    ("/v1/chat/completions", {"messages": CHAT, "tools": [5]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": ["f", None]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [[]], "stream": True}, "tools"),
    # An empty token list among the inputs (its APIError got "input" as its status: a 500).
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input"),
    # A forced tool call (required, or a named function) whose parameters' schema does not
    # compile: refused here, not by the scheduler (a stream's error event after a 200).
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [BAD_SCHEMA_TOOL], "tool_choice": "required", "stream": True},
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [BAD_SCHEMA_TOOL], "tool_choice": NAMED_F},
        "tools",
    ),
    # Constraints no text satisfies (the engine's logits all masked: a 500 before).
    ("/v1/completions", {"prompt": "x", "guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "structured_outputs": {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}},
        "structured_outputs.grammar",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"regex": "[^\\x00-\\U0010FFFF]"}},
        "sampling_params.regex",
    ),
    ("/generate", {"text": "x", "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"text": "x", "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "x", "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"text": ["x", "y", "z"], "return_logprob": [True, False]}, "return_logprob"),
    ("/generate", {"text": "x", "image_data": "a.png"}, "image_data"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": "x", "stream": "yes"}, "stream"),
    ("/generate", {"text": "x", "sampling_params": 5}, "sampling_params"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"temperature": -1}},
        "sampling_params.temperature",
    ),
    ("/generate", {"text": "x", "sampling_params": {"top_k": "4"}}, "sampling_params.top_k"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 0}},
        "sampling_params.max_new_tokens",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 600}},
        "sampling_params.max_new_tokens",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}},
        "sampling_params.min_new_tokens",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"logit_bias": {"-1": 1}}},
        "sampling_params.logit_bias",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"stop_token_ids": [VOCAB + 5]}},
        "sampling_params.stop_token_ids",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"json_schema": "{not json"}},
        "sampling_params.json_schema",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        "sampling_params.ebnf",
    ),
    ("/generate", {"text": ["x", "y"], "sampling_params": [{}]}, "sampling_params"),
    (
        "/generate",
        {"text": ["x", "y"], "sampling_params": [{}, {"n": 0}]},
        "sampling_params.n",
    ),
    ("/generate", {"text": ["x", "y"], "rid": ["a"]}, "rid"),
    # SGLang's request priority: an integer (not a string, float or boolean) within int64.
    ("/generate", {"text": "x", "priority": "high"}, "priority"),
    ("/generate", {"text": "x", "priority": 1.5}, "priority"),
    ("/generate", {"text": "x", "priority": True}, "priority"),
    ("/generate", {"text": "x", "priority": 2**63}, "priority"),
    ("/v1/completions", {"prompt": "x", "priority": "1"}, "priority"),
    ("/v1/chat/completions", {"messages": CHAT, "priority": 2.0}, "priority"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
]


def test_extension_and_native_refusals_name_the_parameter(app):
    for path, body, param in REFUSED:
        r = app.http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"], (path, body, error)
        assert app.frontend._tracked == {}, (path, body)
    assert app.pipeline.take_received() == []  # nothing left the API server


def test_priority_reaches_the_pipeline(app):
    """The request's priority (default 0) rides on its sampling parameters."""
    for path, body, want in [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": 7}, 7),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "priority": -3}, -3),
        ("/generate", {"text": ["x", "y"], "priority": 2**62}, 2**62),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 0),
    ]:
        assert app.http.post(path, json=body).status_code == 200, (path, body)
        received = app.pipeline.take_received()
        assert received and all(m.sampling_params.priority == want for m in received), path


def test_health_generate_runs_a_token_through_the_pipeline(app):
    assert app.http.get("/health_generate").json() == {"status": "ok"}
    (msg,) = app.pipeline.take_received()
    assert isinstance(msg, TokenizeMsg) and msg.sampling_params.max_tokens == 1
    assert app.frontend._tracked == {}
    app.frontend.fail_all_threadsafe("the scheduler process died")
    r = app.http.get("/health_generate")
    assert r.status_code == 503 and r.json()["status"] == "unhealthy"


# Requests past --max-batch-prompts (1,024 sequences, prompts x n, by default): a 400 naming
# the limit, before anything is tokenized.
TOO_MANY = [
    ("/v1/completions", {"prompt": ["x"] * 10_000}, "prompt", 10_000),
    ("/v1/completions", {"prompt": [[1, 2]] * 10_000}, "prompt", 10_000),
    ("/v1/completions", {"prompt": ["x"] * 100, "n": 11}, "n", 1_100),
    ("/generate", {"text": ["x"] * 10_000}, "text", 10_000),
    (
        "/generate",
        {"input_ids": [[1]] * 10_000, "sampling_params": [{}] * 10_000},
        "input_ids",
        10_000,
    ),
    ("/generate", {"text": ["x"] * 600, "sampling_params": {"n": 2}}, "sampling_params.n", 1_200),
    ("/generate", {"text": ["x"] * 2, "sampling_params": [{"n": 64}] * 17}, "sampling_params", 0),
]


def test_batches_past_max_batch_prompts_are_refused_before_tokenization(app):
    for path, body, param, sequences in TOO_MANY:
        r = app.http.post(path, json=body)
        assert r.status_code == 400, (path, param, r.text[:300])
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), (path, error)
        if sequences:
            assert error["type"] == "invalid_request_error"
            assert f"asks for {sequences} sequences" in error["message"], error
            assert "--max-batch-prompts 1024" in error["message"], error
        assert app.frontend._tracked == {}
    assert app.pipeline.take_received() == []  # nothing reached the tokenizer
    # At the limit: served (16 prompts x n = 64, and 16 x 64 on /generate: 1,024 each).
    r = app.http.post("/v1/completions", json={"prompt": ["x"] * 16, "n": 64, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1024
    body = {"text": ["x"] * 16, "sampling_params": [{"n": 64}] * 16}
    r = app.http.post("/generate", json=body)
    assert r.status_code == 200 and len(r.json()) == 1024
    assert len(app.pipeline.take_received()) == 2048


# Bodies the Anthropic and Responses routes read themselves: as strict as the OpenAI routes'
# (Python's json.loads took NaN, 1e999 and lone surrogates, which failed only when a response
# echoed them back, and overflowed its recursion limit on deep nesting: 500s).
RESPONSES_BODY = b'{"input": "hi", "max_output_tokens": 2, "metadata": {"a": "b"}, "x": %s}'
MESSAGES_BODY = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "x": %s}'
NOT_JSON = [b"NaN", b"-Infinity", b"1e999", b'"\\ud800"', b'{"a":' * 5000]


def test_translated_bodies_are_parsed_strictly(app):
    headers = {"Content-Type": "application/json"}
    for value in NOT_JSON:
        r = app.http.post("/v1/responses", content=RESPONSES_BODY % value, headers=headers)
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["code"] == "invalid_json" and r.json()["error"]["param"] == "body"
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = app.http.post(path, content=MESSAGES_BODY % value, headers=headers)
            assert r.status_code == 400, (path, value, r.text)
            error = r.json()
            assert error["type"] == "error" and "not valid JSON" in error["error"]["message"]
    assert app.pipeline.take_received() == []
    # Finite numbers and surrogate pairs are JSON as usual.
    body = RESPONSES_BODY % b'[1e300, "\\ud83d\\ude00"]'
    r = app.http.post("/v1/responses", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"a": "b"}


def test_responses_flags_and_metadata_are_checked_before_they_are_echoed(app):
    """`store` and `stream` are booleans; `metadata`, echoed in the response, is OpenAI's up to
    16 pairs of strings (keys up to 64 characters, values up to 512)."""
    bad = [
        ("store", "x"),
        ("stream", "false"),
        ("metadata", "x"),
        ("metadata", {"a": 1}),
        ("metadata", {"k" * 65: "v"}),
        ("metadata", {"a": "v" * 513}),
        ("metadata", {str(i): "v" for i in range(17)}),
    ]
    for name, value in bad:
        r = app.http.post("/v1/responses", json={"input": "hi", name: value})
        assert r.status_code == 400, (name, value, r.text)
        assert r.json()["error"]["param"] == name, r.text
    assert app.pipeline.take_received() == []
    pairs = {str(i): "v" * 512 for i in range(16)}
    r = app.http.post("/v1/responses", json={"input": "hi", "metadata": pairs, "store": False})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == pairs


def test_an_internal_error_has_the_routes_error_shape(app, monkeypatch):
    """A bug's 500 on Anthropic's routes comes in Anthropic's error shape, elsewhere OpenAI's."""
    import minisgl.server.anthropic as anthropic

    def broken(body):
        raise RuntimeError("boom")

    monkeypatch.setattr(anthropic, "chat_body", broken)
    http = TestClient(app.http.app, raise_server_exceptions=False)
    r = http.post("/v1/messages", json={"max_tokens": 2, "messages": CHAT})
    assert r.status_code == 500
    assert r.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal error: boom"},
    }
    monkeypatch.setattr(app.frontend, "new_rid", lambda: 1 / 0)
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
