"""The server's building blocks without processes: SSE chunks, message codec, scheduler I/O
loop and the detokenize manager (stop strings -> abort)."""

from __future__ import annotations

import json

import msgpack
import pytest
from helpers import build_llm

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    BatchMsg,
    ErrorMsg,
    FlushCacheMsg,
    FlushCacheReply,
    OutputMsg,
    StatsMsg,
    TokenizeMsg,
    TokenMsg,
    UserMsg,
    decode,
    encode,
)
from minisgl.scheduler.io import SchedulerIO
from minisgl.server.responses import ResponseFormatter
from minisgl.tokenizer.server import DetokenizeManager, tokenize_request


@pytest.mark.parametrize("chat", [False, True])
def test_sse_chunks_are_openai_json(chat):
    fmt = ResponseFormatter(chat, "cmpl-1", 'a "model" \u00e9', 1700000000, 1)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def parsed(event: str) -> dict:
        assert event.startswith("data: ") and event.endswith("\n\n")
        body = json.loads(event[len("data: ") : -2])
        assert {k: body.pop(k) for k in ("id", "object", "created", "model")} == {
            "id": "cmpl-1",
            "object": obj,
            "created": 1700000000,
            "model": 'a "model" \u00e9',
        }
        return body

    for text in [" hello", 'q"uote\\ \n\t\u2028', "\u00e9\u4e2d\U0001f600", "}]}"]:
        content = {"delta": {"content": text}} if chat else {"text": text}
        choice = {"index": 3, **content, "logprobs": None, "finish_reason": None}
        assert parsed(fmt.chunk(3, text, None)) == {"choices": [choice]}
    content = {"delta": {}} if chat else {"text": ""}
    choice = {"index": 0, **content, "logprobs": None, "finish_reason": "length"}
    assert parsed(fmt.chunk(0, None, "length")) == {"choices": [choice]}
    if chat:
        role = {"index": 1, "delta": {"role": "assistant", "content": ""}}
        expected = {"choices": [{**role, "logprobs": None, "finish_reason": None}]}
        assert parsed(fmt.chunk(1, None, None, role=True)) == expected


def test_codec_round_trips_nested_messages():
    sp = SamplingParams(temperature=0.5, top_k=3, stop=["\n\n", "end"], seed=7, max_tokens=9)
    msg = BatchMsg(
        [
            TokenizeMsg(1, sp, messages=[{"role": "user", "content": "héllo 🙂"}]),
            TokenizeMsg(2, SamplingParams(), input_ids=[1, 2, 3]),
            AbortMsg(3),
            OutputMsg(4, "中文", 2, "stop", completion_tokens=5, cached_tokens=1),
        ]
    )
    assert decode(encode(msg)) == msg


def test_codec_refuses_unregistered_types():
    class NotAMessage:
        pass

    with pytest.raises(TypeError):
        encode(AbortMsg(NotAMessage()))  # type: ignore[arg-type]
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["os.system", "ls"])))
    with pytest.raises(ValueError, match="unknown message type"):
        decode(forged)


class FakeInbox:
    def __init__(self) -> None:
        self.items: list = []

    def get(self, timeout_s: float | None = None) -> list:
        assert self.items or timeout_s is not None, "the scheduler would block here forever"
        return self.drain()

    def drain(self) -> list:
        items, self.items = self.items, []
        return items


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list = []

    def put_many(self, msgs: list) -> None:
        self.sent.extend(msgs)


@pytest.fixture(scope="module")
def llm():
    llm = build_llm("qwen3", max_seq_len_override=64)
    yield llm
    llm.shutdown()


def run_until_idle(io: SchedulerIO, steps: int = 200) -> None:
    for _ in range(steps):
        io.run_once()
        if not io.scheduler.has_work:
            return
    raise AssertionError("scheduler did not go idle")


def test_scheduler_io_accepts_rejects_streams_and_aborts(llm):
    inbox, outbox = FakeInbox(), FakeOutbox()
    io = SchedulerIO(llm, inbox, outbox)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    long = SamplingParams(max_tokens=40, ignore_eos=True, stop=["x"])
    inbox.items = [
        UserMsg(10, [1, 2, 3], greedy),
        UserMsg(11, list(range(1, 100)), greedy),  # longer than the 64-token context
        UserMsg(12, [4, 5, 6], long),
        UserMsg(13, [1, 2, 3], SamplingParams(max_tokens=62)),  # 3 + 62 > 64: refused
    ]
    io.run_once()  # drains all four, then steps once
    inbox.items = [AbortMsg(12), AbortMsg(99)]  # 99: unknown, ignored
    run_until_idle(io)
    by_rid: dict[int, list] = {}
    for m in outbox.sent:
        if not isinstance(m, StatsMsg):
            by_rid.setdefault(m.rid, []).append(m)
    for rid, param in [(11, "prompt"), (13, "max_tokens")]:
        assert by_rid[rid] == [
            ErrorMsg(rid, by_rid[rid][0].message, param, "context_length_exceeded")
        ]
    assert by_rid[10][0] == AcceptedMsg(10, 3, [], True)
    assert by_rid[12][0] == AcceptedMsg(12, 3, ["x"], True)
    tokens10 = by_rid[10][1:]
    assert [m.finish_reason for m in tokens10] == [None, None, None, "length"]
    assert all(isinstance(m, TokenMsg) and m.token is not None for m in tokens10)
    assert by_rid[12][-1].finish_reason == "abort" and by_rid[12][-1].token is None
    assert io.rid_to_uid == {} and io.uid_to_rid == {}
    stats = outbox.sent[-1]
    assert isinstance(stats, StatsMsg) and stats.idle and stats.pages_ok
    assert stats.free_pages + stats.cached_pages == stats.num_pages


def test_an_idle_scheduler_gives_freed_memory_back_once(llm, monkeypatch):
    """After a request, the first wait that times out hands the heap's freed memory back; the
    next waits block without a timeout until work comes."""
    import minisgl.scheduler.io as scheduler_io

    released: list[int] = []
    monkeypatch.setattr(scheduler_io, "release_freed_memory", lambda: released.append(1))
    timeouts: list[float | None] = []
    inbox, outbox = FakeInbox(), FakeOutbox()
    get = inbox.get
    inbox.get = lambda timeout_s=None: timeouts.append(timeout_s) or get(timeout_s)
    io = SchedulerIO(llm, inbox, outbox, idle_release_s=0.25)
    inbox.items = [UserMsg(20, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
    run_until_idle(io)
    assert timeouts == [None] and released == []  # nothing freed before the first request
    io.run_once()  # nothing arrives within idle_release_s
    assert timeouts == [None, 0.25] and released == [1]
    inbox.items = [UserMsg(21, [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))]
    io.run_once()  # a wait without a timeout: it was released
    assert timeouts[-1] is None
    run_until_idle(io)
    inbox.items = [AbortMsg(99)]  # a message that brings no work restarts the wait
    io.run_once()
    assert timeouts[-1] == 0.25 and released == [1]


def test_detokenize_manager_cuts_stop_string_and_aborts(llm):
    tok = llm.tokenizer
    ids = tok("alpha beta gamma delta", add_special_tokens=False).input_ids
    manager = DetokenizeManager(tok)
    to_api, aborts = manager.handle([AcceptedMsg(5, 3, ["gamma"], True)])
    assert to_api == [AcceptedMsg(5, 3, ["gamma"], True)] and aborts == []
    texts, finish = [], None
    for i, t in enumerate(ids):
        out, aborts = manager.handle([TokenMsg(5, t, None, cached_tokens=2 if i == 0 else 0)])
        for m in out:
            texts.append(m.text)
            finish = m.finish_reason or finish
            last = m
        if finish:
            break
    assert "".join(texts) == "alpha beta "
    assert finish == "stop" and aborts == [AbortMsg(5)]
    assert last.cached_tokens == 2 and last.completion_tokens == i + 1
    # The scheduler's late tokens and its abort confirmation are dropped.
    assert manager.handle([TokenMsg(5, ids[0]), TokenMsg(5, None, "abort")]) == ([], [])


def test_tokenize_request_forms(llm):
    tok = llm.tokenizer
    sp = SamplingParams()
    chat = tokenize_request(tok, TokenizeMsg(1, sp, messages=[{"role": "user", "content": "hi"}]))
    assert tok.decode(chat.input_ids).endswith("<|im_start|>assistant\n")
    assert tokenize_request(tok, TokenizeMsg(2, sp, text="hi")).input_ids == tok("hi").input_ids
    assert tokenize_request(tok, TokenizeMsg(3, sp, input_ids=[7, 8])).input_ids == [7, 8]


class _FailingDecode:
    """A tokenizer whose decode raises on one token id (a bug in one request's text)."""

    def __init__(self, tokenizer, bad_token: int) -> None:
        self.tokenizer, self.bad_token = tokenizer, bad_token

    def decode(self, ids, **kw):
        if self.bad_token in ids:
            raise RuntimeError("cannot decode")
        return self.tokenizer.decode(ids, **kw)


def test_detokenize_failure_ends_only_that_request(llm):
    tok = llm.tokenizer
    ids = tok("alpha beta gamma", add_special_tokens=False).input_ids
    bad = tok(" zeta", add_special_tokens=False).input_ids[0]
    manager = DetokenizeManager(_FailingDecode(tok, bad))
    manager.handle([AcceptedMsg(1, 3), AcceptedMsg(2, 3)])
    # One batch: request 2 hits the failing token between request 1's tokens.
    to_api, aborts = manager.handle(
        [TokenMsg(1, ids[0]), TokenMsg(2, ids[0]), TokenMsg(2, bad), TokenMsg(1, ids[1])]
    )
    assert aborts == [AbortMsg(2)]
    errors = [m for m in to_api if isinstance(m, ErrorMsg)]
    assert len(errors) == 1 and errors[0].rid == 2 and errors[0].code == "request_failed"
    assert "cannot decode" in errors[0].message
    assert [m.rid for m in to_api if isinstance(m, OutputMsg)] == [1]  # 2's text is dropped
    assert set(manager.states) == {1}
    # The failed request's late tokens and its abort confirmation are ignored; 1 goes on.
    to_api, aborts = manager.handle(
        [TokenMsg(2, ids[1]), TokenMsg(2, None, "abort"), TokenMsg(1, ids[2], "length")]
    )
    assert aborts == [] and [m.rid for m in to_api] == [1]
    assert to_api[0].finish_reason == "length" and to_api[0].completion_tokens == 3


def test_tokenize_errors_blame_the_prompt_or_the_server():
    from jinja2 import TemplateError

    from minisgl.tokenizer.server import tokenize_error

    chat = TokenizeMsg(1, SamplingParams(), messages=[{"role": "user", "content": "x"}])
    text = TokenizeMsg(2, SamplingParams(), text="x")
    refused = tokenize_error(chat, TemplateError("roles must alternate"))
    assert (refused.param, refused.code) == ("messages", "invalid_value")
    assert "roles must alternate" in refused.message
    assert (tokenize_error(text, ValueError("no")).param) == "prompt"
    failed = tokenize_error(text, RuntimeError("tokenizer bug"))
    assert (failed.param, failed.code) == (None, "request_failed")


def test_push_queue_sends_what_can_be_encoded(tmp_path):
    from minisgl.message.queue import ZmqPullQueue, ZmqPushQueue, ipc_address

    address = ipc_address(str(tmp_path), "q")
    inbox, outbox = ZmqPullQueue(address), ZmqPushQueue(address)
    try:
        unencodable = ErrorMsg(2, "x", None, None)
        unencodable.rid = 2**64  # type: ignore[assignment]
        msgs = [AbortMsg(1), unencodable, AbortMsg(3)]
        failed = outbox.put_encodable(msgs)
        assert [m for m, _ in failed] == [unencodable]  # msgpack holds at most 64 bits
        assert inbox.socket.poll(5000)
        assert inbox.get() == [AbortMsg(1), AbortMsg(3)]
    finally:
        outbox.close()
        inbox.close()


def test_fault_injection_spec():
    from minisgl.utils.faults import _parse

    assert _parse(None) is None
    assert _parse("tokenize,detokenize:@x;crash:@y") == {
        "tokenize": "@x",
        "detokenize": "@x",
        "crash": "@y",
    }
    for bad in ["tokenize", "tokenize:", "nowhere:@x", ":@x", "tokenize:@x;"]:
        with pytest.raises(ValueError, match="MINISGL_FAULT_INJECT"):
            _parse(bad)


def test_flush_cache_only_when_idle_and_pages_stay_accounted(llm):
    """FlushCacheMsg: refused while a request is queued or running, else the radix tree is
    emptied and every page is free (free + cached == all pages before and after)."""
    inbox, outbox = FakeInbox(), FakeOutbox()
    io = SchedulerIO(llm, inbox, outbox)
    inbox.items = [UserMsg(1, list(range(1, 40)), SamplingParams(max_tokens=4)), FlushCacheMsg(2)]
    io.run_once()
    refused = [m for m in outbox.sent if isinstance(m, FlushCacheReply)]
    assert refused == [FlushCacheReply(2, False, refused[0].message)]
    assert "1 running" in refused[0].message or "1 waiting" in refused[0].message
    run_until_idle(io)
    cm = llm.cache_manager
    assert cm.prefix_cache.size_info.total_size > 0  # the prompt and output are cached
    outbox.sent.clear()
    inbox.items = [FlushCacheMsg(3)]
    io.run_once()
    reply, stats = outbox.sent[0], outbox.sent[1]
    assert isinstance(reply, FlushCacheReply) and reply.flushed and reply.rid == 3
    assert isinstance(stats, StatsMsg) and stats.cached_pages == 0 and stats.pages_ok
    assert cm.num_free_pages == llm.engine.num_pages
    assert cm.prefix_cache.size_info.total_size == 0
    # The emptied tree works as before: the same prompt again is computed from scratch.
    out = llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2))[0]
    assert out["cached_tokens"] == 0
    assert llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2))[0]["cached_tokens"]


def test_text_requests_and_stop_tokens(llm):
    """EncodeMsg / DecodeMsg answers (/tokenize, /detokenize); an EOS / stop token ends the
    text without its own unless stop strings are included; chat rendering options."""
    from minisgl.message import DecodedMsg, DecodeMsg, EncodedMsg, EncodeMsg
    from minisgl.tokenizer.server import answer_text_request, text_request_error

    tok = llm.tokenizer
    encoded = answer_text_request(tok, EncodeMsg(1, text="hi there", return_token_strs=True))
    assert encoded == EncodedMsg(1, tok("hi there").input_ids, ["hi", "Ġthere"])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    cont = answer_text_request(
        tok, EncodeMsg(2, messages=chat, add_generation_prompt=False, continue_final_message=True)
    )
    assert tok.decode(cont.tokens).endswith("<|im_start|>assistant\nHel")
    closed = answer_text_request(tok, EncodeMsg(3, messages=chat[:1], add_generation_prompt=False))
    assert not tok.decode(closed.tokens).endswith("assistant\n")
    assert answer_text_request(tok, DecodeMsg(4, [1, 2])) == DecodedMsg(4, "<|im_start|><|im_end|>")
    bad = EncodeMsg(5, messages=chat, chat_template_kwargs={"tokenize": True})
    try:
        answer_text_request(tok, bad)
    except ValueError as exc:
        assert text_request_error(bad, exc).param == "messages"
    else:
        raise AssertionError("a reserved chat_template_kwargs key must be refused")
    ids = tok(" alpha beta", add_special_tokens=False).input_ids
    for include, text in [(False, " alpha"), (True, " alpha beta")]:
        manager = DetokenizeManager(tok)
        manager.handle([AcceptedMsg(7, 3, [], True, True, include)])
        out, _ = manager.handle([TokenMsg(7, ids[0]), TokenMsg(7, ids[1], "stop")])
        assert "".join(m.text for m in out) == text
        assert out[-1].completion_tokens == 2 and out[-1].matched_stop == ids[1]


def test_chat_template_kwargs_reach_the_template(llm):
    """chat_template_kwargs are the template's variables (Qwen3's enable_thinking, say)."""
    import copy

    from minisgl.tokenizer.tokenize import render_chat

    tok = copy.copy(llm.tokenizer)
    tok.chat_template = (
        "{{ 'think:' if enable_thinking else 'plain:' }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    chat = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, chat, chat_template_kwargs={"enable_thinking": True}) == "think:hi"
    assert render_chat(tok, chat) == "plain:hi"


def test_codec_round_trips_the_new_messages():
    from minisgl.message import DecodedMsg, DecodeMsg, EncodedMsg, EncodeMsg

    sp = SamplingParams(
        min_tokens=2, logit_bias={5: -1.5, 7: 100.0}, include_stop_str_in_output=True
    )
    msg = BatchMsg(
        [
            TokenizeMsg(
                1,
                sp,
                messages=[{"role": "user", "content": "x"}],
                chat_template_kwargs={"a": [1, None]},
            ),
            EncodeMsg(2, text="x", return_token_strs=True),
            EncodedMsg(2, [1, 2], ["a", "b"]),
            DecodeMsg(3, [4]),
            DecodedMsg(3, "é"),
            FlushCacheMsg(4),
            FlushCacheReply(4, False, "busy"),
            OutputMsg(5, "", 1, "stop", matched_stop=2),
        ]
    )
    assert decode(encode(msg)) == msg
