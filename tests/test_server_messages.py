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

    def get(self) -> list:
        assert self.items, "the scheduler would block here forever"
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
    ]
    io.run_once()  # drains all three, then steps once
    inbox.items = [AbortMsg(12), AbortMsg(99)]  # 99: unknown, ignored
    run_until_idle(io)
    by_rid: dict[int, list] = {}
    for m in outbox.sent:
        if not isinstance(m, StatsMsg):
            by_rid.setdefault(m.rid, []).append(m)
    assert isinstance(by_rid[11][0], ErrorMsg) and by_rid[11][0].code == "context_length_exceeded"
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
