"""vLLM's request extensions on the OpenAI endpoints (with the official `openai` client) and
the native endpoints (SGLang's /generate, /flush_cache, info and health; vLLM's /tokenize and
/detokenize) over plain HTTP, on one real server: each parameter's effect, each refusal a 400
naming it, pages accounted for at the end."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from helpers import smollm2
from test_server import API_KEY, CHATS, STOP_PROMPT, metrics, wait_for, wait_healthy

import minisgl
from minisgl.tokenizer import encode_chat, load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
IM_START = 1  # SmolLM2's <|im_start|>: a special token that is not an EOS


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's server (conftest.py; test_server.py's settings and API key)."""
    return wait_healthy(smollm2_server)


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2())


def generate(http: httpx.Client, **body) -> dict | list:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(http: httpx.Client, path: str, body: dict) -> list:
    """A stream's SSE events, parsed ([DONE] as the string)."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [x if x == "[DONE]" else json.loads(x) for x in (line[6:] for line in lines)]


def test_tokenize_and_detokenize(http, tok):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok("Hello world").input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == ["Hello", "Ġworld"]
    chat = http.post("/tokenize", json={"messages": CHATS[1]}).json()
    assert chat["tokens"] == encode_chat(tok, CHATS[1]) and chat["token_strs"] is None
    closed = http.post("/tokenize", json={"messages": CHATS[1], "add_generation_prompt": False})
    assert closed.json()["tokens"] == chat["tokens"][: len(closed.json()["tokens"])]
    assert closed.json()["count"] < chat["count"]
    back = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": tok.decode(chat["tokens"])} and "<|im_start|>" in back["prompt"]
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_generate_matches_completions_and_reports_meta_info(http, client):
    params = {"max_new_tokens": 8, "temperature": 0}
    one = generate(http, text="The capital of France is", sampling_params=params, rid="r1")
    want = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert one["text"] == want.choices[0].text
    meta = one["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == want.usage.prompt_tokens
    assert meta["completion_tokens"] == 8 and meta["finish_reason"] == {
        "type": "length",
        "length": 8,
    }
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    batch = generate(http, input_ids=[ids, ids[:3]], sampling_params={**params, "n": 2})
    assert isinstance(batch, list) and len(batch) == 4
    assert batch[0]["text"] == batch[1]["text"] == one["text"]  # greedy: both samples agree
    assert [b["meta_info"]["id"][-2:] for b in batch] == ["-0", "-1", "-0", "-1"]
    # A stop string (cut, or kept with no_stop_trim) and EOS name what matched.
    stop = one["text"][3:7]
    cut = generate(http, text="The capital of France is", sampling_params={**params, "stop": stop})
    assert cut["text"] == one["text"][:3]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = {**params, "stop": stop, "no_stop_trim": True}
    assert (
        generate(http, text="The capital of France is", sampling_params=kept)["text"]
        == (one["text"][:7])
    )
    chat_prompt = http.post("/tokenize", json={"messages": CHATS[0]}).json()["tokens"]
    ended = generate(http, input_ids=chat_prompt, sampling_params={"temperature": 0})
    assert ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # <|im_end|>


def test_generate_streams_cumulative_text(http):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    whole = generate(http, **body)
    streamed = events(http, "/generate", {**body, "stream": True})
    assert streamed[-1] == "[DONE]" and len(streamed) > 3
    texts = [e["text"] for e in streamed[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each is the text so far
    assert texts[-1] == whole["text"]
    assert [e["meta_info"]["finish_reason"] for e in streamed[:-1]][-1]["type"] == "length"
    assert all("index" not in e for e in streamed[:-1])
    batch = events(http, "/generate", {**body, "text": ["a", "b"], "stream": True})
    assert {e["index"] for e in batch[:-1]} == {0, 1} and batch[-1] == "[DONE]"


def test_logit_bias_forces_and_forbids_tokens(client, tok):
    token = tok(" banana", add_special_tokens=False).input_ids[0]
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == tok.decode([token] * 4)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=3, temperature=0.7, logit_bias={str(token): 100}
    )
    assert chat.choices[0].message.content == tok.decode([token] * 3)
    free = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    first = tok(free.choices[0].text, add_special_tokens=False).input_ids[0]
    banned = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != free.choices[0].text


def test_min_tokens_holds_off_eos_and_stop_ids(client):
    free = client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0)
    k = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and k < 60
    held = client.chat.completions.create(
        model=MODEL,
        messages=CHATS[0],
        temperature=0,
        max_tokens=k + 12,
        extra_body={"min_tokens": k + 8, "skip_special_tokens": False},
    )
    assert held.usage.completion_tokens >= k + 8
    assert "<|im_end|>" not in held.choices[0].message.content  # EOS never drawn early
    commas = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    stopped = client.completions.create(model=MODEL, **commas, extra_body={"stop_token_ids": [28]})
    assert stopped.usage.completion_tokens < 6  # "," (28) comes soon
    held = client.completions.create(
        model=MODEL, **commas, extra_body={"stop_token_ids": [28], "min_tokens": 6}
    )
    assert held.usage.completion_tokens >= 6


def test_special_tokens_kept_or_skipped(client):
    request = dict(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    bias = {"logit_bias": {str(IM_START): 100}}
    skipped = client.completions.create(**request, extra_body=bias)
    assert skipped.choices[0].text == "" and skipped.usage.completion_tokens == 3
    for spaces in (True, False):  # a Rust-backed tokenizer never adds the spaces
        kept = client.completions.create(
            **request,
            extra_body={
                **bias,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": spaces,
            },
        )
        assert kept.choices[0].text == "<|im_start|>" * 3


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, stream):
    request = dict(model=MODEL, prompt=STOP_PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**request).choices[0].text
    stop = full[len(full) // 3 : len(full) // 3 + 5]
    kwargs = dict(**request, stop=[stop], extra_body={"include_stop_str_in_output": True})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == full[: full.find(stop) + len(stop)] and text.endswith(stop)


def test_continuous_usage_stats(client):
    for include in (True, False):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=CHATS[0],
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": include, "continuous_usage_stats": True},
            )
        )
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
        assert all(
            c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            for c in chunks
        )
        assert (chunks[-1].choices == []) == include  # the closing usage-only chunk


def test_chat_template_options(client, http):
    partial = [*CHATS[0], {"role": "assistant", "content": "The capital of France is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    ids = http.post("/tokenize", json={"messages": partial, **options}).json()["tokens"]
    continued = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=6, temperature=0, extra_body=options
    )
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert continued.choices[0].message.content == plain.choices[0].text
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True}
    with_kwargs = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=4, temperature=0, user="u-1", extra_body=kwargs
    )
    assert with_kwargs.choices[0].message.content  # SmolLM2's template has no such variable


def test_unknown_fields_are_ignored_with_a_warning(server, client, http):
    start = len(server.log_text())
    resp = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_body={"frobnicate": 1}
    )
    assert resp.usage.completion_tokens == 1
    generate(http, text="Hi", sampling_params={"max_new_tokens": 1, "wobble": True})
    log = server.log_text()[start:]
    assert "WARNING" in log and "frobnicate" in log and "sampling_params.wobble" in log


def test_pipeline_refusals_name_the_native_parameter(http):
    """Refused past the API server (the scheduler: context, vocabulary), named as /generate
    names them. (The API server's own refusals: tests/test_server_validation.py.)"""
    for body, param in [
        ({"input_ids": [99999999]}, "input_ids"),
        ({"text": "hello " * 600}, "text"),
        (
            {"text": "hello " * 400, "sampling_params": {"max_new_tokens": 200}},
            "sampling_params.max_new_tokens",
        ),
    ]:
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert generate(http, text="Hi", sampling_params={"max_new_tokens": 1})["text"] is not None


def test_info_health_and_auth(server, http):
    assert http.get("/version").json() == {"version": minisgl.__version__}
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(smollm2()) and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    server_info = http.get("/get_server_info").json()
    assert server_info["max_model_len"] == 512 and server_info["page_size"] == 1
    assert server_info["max_total_num_tokens"] == server_info["num_pages"] == 4096
    assert server_info["api_key_required"] is True and "api_key" not in server_info
    assert httpx.get(f"{server.url}/health_generate", timeout=60).json() == {"status": "ok"}
    assert httpx.post(f"{server.url}/generate", json={"text": "x"}).status_code == 401
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{server.url}/flush_cache").status_code == 401


def test_flush_cache_empties_the_tree_only_when_idle(server, http):
    generate(http, text=STOP_PROMPT, sampling_params={"max_new_tokens": 4})
    assert wait_for(lambda: metrics(server.url)["minisgl_kv_pages{state=cached}"] > 0)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and "cache flushed" in r.text
    m = metrics(server.url)
    assert m["minisgl_kv_pages{state=cached}"] == 0
    assert m["minisgl_kv_pages{state=free}"] == m["minisgl_kv_pages{state=total}"]
    # A request running: refused, nothing changed; once it is gone, flushed.
    started, stop = threading.Event(), threading.Event()
    body = {
        "text": "Tell me a story",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }

    def stream() -> None:
        with httpx.Client(base_url=server.url, headers=http.headers, timeout=120) as own:
            with own.stream("POST", "/generate", json={**body, "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        break

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    busy = http.get("/flush_cache")
    stop.set()
    reader.join(60)
    assert busy.status_code == 400 and "running" in busy.text
    wait_for(lambda: metrics(server.url)["minisgl_num_requests_running"] == 0, what="abort")
    assert wait_for(lambda: http.post("/flush_cache").status_code == 200, what="flush")


def test_zz_pages_accounted_for(server):
    m = wait_for(
        lambda: (mm := metrics(server.url))["minisgl_page_accounting_ok"] == 1 and mm,
        what="page accounting",
    )
    pages = [m[f"minisgl_kv_pages{{state={s}}}"] for s in ("free", "cached", "total")]
    assert pages[0] + pages[1] == pages[2]
    assert "Traceback" not in server.log_text()
