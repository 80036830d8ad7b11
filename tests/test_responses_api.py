"""OpenAI's Responses API over HTTP with the official client (server/openai_responses.py): a
response means the chat request it translates to (the same greedy text), whole or streamed
as events the client parses into its own types; function calls and their outputs, text.format,
reasoning items, stored responses chained with previous_response_id (the radix cache serving
the earlier turns), retrieve/delete/input_items and errors in OpenAI's shape."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import TypeAdapter
from test_server import wait_healthy

from minisgl.server.openai_responses import ResponseEvents
from minisgl.server.response_store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_qwen3_server):
    return wait_healthy(tiny_qwen3_server)


def chat_text(client, model, messages, max_tokens, **extra) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **extra
    )
    return reply.choices[0].message.content or ""


def test_a_response_is_the_chat_request_it_means_whole_and_streamed(client, model) -> None:
    ask = dict(model=model, instructions="You are terse.", input="Name a color.", **GREEDY)
    response = client.responses.create(**ask, max_output_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert response.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "You are terse." and response.max_output_tokens == 12

    events = list(client.responses.create(**ask, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{response.status}",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    usage = events[-1].response.usage  # (its cached tokens are the first request's prompt)
    assert (usage.input_tokens, usage.output_tokens) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )


def test_function_calls_and_their_outputs_round_trip(client, model) -> None:
    ask = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER], **GREEDY)
    called = client.responses.create(**ask, tool_choice="required", max_output_tokens=200)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", called.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."}
    answer = client.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=10,
        **GREEDY,
    )
    # The same conversation as chat messages, sent whole.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ],
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny."},
    ]
    expected = chat_text(client, model, messages, 10, tools=[CHAT_WEATHER])
    assert answer.output_text == expected
    assert answer.usage.input_tokens_details.cached_tokens > 0

    # Streamed, a forced call comes as its item's events, arguments whole.
    events = list(client.responses.create(**ask, tool_choice="required", stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    assert events[-1].type == "response.completed"


def test_text_format_json_schema_holds(client, model) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 10}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": schema, "strict": True}}
    response = client.responses.create(
        model=model, input="A color as JSON.", text=fmt, max_output_tokens=80, **GREEDY
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_chained_conversation_reuses_the_earlier_turns_kv(client, model) -> None:
    """Five turns chained with previous_response_id: each after the first finds (about) all
    earlier turns in the radix cache, and its text is that of the whole conversation sent as a
    chat request."""
    messages: list[dict] = []
    previous, seen = None, 0
    for turn in range(5):
        question = f"Question {turn}: name a fruit."
        response = client.responses.create(
            model=model,
            input=question,
            previous_response_id=previous,
            max_output_tokens=6,
            **GREEDY,
        )
        messages.append({"role": "user", "content": question})
        assert response.output_text == chat_text(client, model, messages, 6)
        messages.append({"role": "assistant", "content": response.output_text})
        usage = response.usage
        if turn > 0:  # the earlier turns, less the tokens where a turn's end re-tokenizes
            assert usage.input_tokens_details.cached_tokens >= seen - 3, (turn, usage, seen)
        seen = usage.input_tokens + usage.output_tokens
        previous = response.id


def test_reasoning_items_and_calls_after_reasoning(client, model) -> None:
    """--reasoning-parser qwen3 (the shared server's): thinking (the output held to a form by
    a regex) comes back as a reasoning item, streamed as reasoning_text deltas, then the
    answer; a tool call after the thinking is a function_call item."""
    think = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){0,2}\n</think>\n\n[A-Z][a-z]{2,8}"
    ask = dict(model=model, input="Think, then answer.", max_output_tokens=40, **GREEDY)
    response = client.responses.create(**ask, extra_body={"guided_regex": think})
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    reasoning = response.output[0].content[0].text
    assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){0,2}\n", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", response.output_text)
    events = list(client.responses.create(**ask, stream=True, extra_body={"guided_regex": think}))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning
    assert events[-1].response.output_text == response.output_text

    call = (
        r'<think>\n[a-z]{3,8}\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "[A-Z][a-z]{2,5}"\}\}\n</tool_call>'
    )
    ask = {**ask, "tools": [WEATHER], "max_output_tokens": 160}
    called = client.responses.create(**ask, extra_body={"guided_regex": call})
    assert [item.type for item in called.output] == ["reasoning", "function_call"]
    assert called.output[1].name == "get_weather"
    assert json.loads(called.output[1].arguments)["city"][0].isupper()


def test_stored_responses_retrieve_list_delete(client, model) -> None:
    first = client.responses.create(model=model, input="Hello.", max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(first.id) == first
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Hello.")
    ]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(
        model=model, input="Hello.", store=False, max_output_tokens=2, **GREEDY
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="Hi.", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({}, "input"),
    ],
)
def test_bad_requests_get_openai_errors(client, model, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, **body)
    assert error.value.body["param"] == param, error.value.body
    assert error.value.body["type"] == "invalid_request_error"


def test_stream_events_parse_as_the_clients_types() -> None:
    """Every event of a stream with reasoning, text and a call validates against the client's
    own event union (pydantic), and each item's done form carries its whole text."""
    events = ResponseEvents()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    text = events.reasoning("hmm ") + events.reasoning("ok") + events.text("Hi") + events.text("!")
    text += events.close() + events.call(call)
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = [
        adapter.validate_python(json.loads(block.split("\ndata: ", 1)[1]))
        for block in text.strip().split("\n\n")
    ]
    assert [p.sequence_number for p in parsed] == list(range(len(parsed)))
    done = [p.item for p in parsed if p.type == "response.output_item.done"]
    assert [d.type for d in done] == ["reasoning", "message", "function_call"]
    assert done[0].content[0].text == "hmm ok" and done[1].content[0].text == "Hi!"
    assert events.output == [d.model_dump(exclude_unset=True) for d in done]


def test_store_keeps_its_bounds_and_its_directory(tmp_path) -> None:
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"resp_{i}", {"n": i})
    assert [store.get(f"resp_{i}") for i in range(5)] == [None, None, {"n": 2}, {"n": 3}, {"n": 4}]
    store = ResponseStore(max_count=100, max_bytes=50)
    store.put("resp_a", {"text": "x" * 30})
    store.put("resp_b", {"text": "y" * 30})  # the pair is past 50 bytes: the older goes
    assert store.get("resp_a") is None and store.get("resp_b") is not None
    with pytest.raises(ValueError, match="not a response id"):
        store.put("../etc", {})
    kept = ResponseStore(max_count=10, directory=str(tmp_path))
    kept.put("resp_x", {"n": 1})
    kept.put("resp_y", {"n": 2})
    assert kept.delete("resp_y") and not kept.delete("resp_y")
    again = ResponseStore(max_count=10, directory=str(tmp_path))  # a restart
    assert again.get("resp_x") == {"n": 1} and again.get("resp_y") is None


def test_chat_reads_a_call_after_reasoning_whole_and_streamed(client, model) -> None:
    """The chat side of the same split: thinking as reasoning_content, the call after it as
    tool_calls (finish_reason tool_calls), streamed as their own deltas."""
    call = (
        r'<think>\n[a-z]{3,8}\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "[A-Z][a-z]{2,5}"\}\}\n</tool_call>'
    )
    ask = dict(
        model=model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CHAT_WEATHER],
        max_tokens=160,
        extra_body={"guided_regex": call},
        **GREEDY,
    )
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert re.fullmatch(r"[a-z]{3,8}\n", choice.message.model_extra["reasoning_content"])
    (whole,) = choice.message.tool_calls
    reasoning, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for delta_choice in chunk.choices:
            delta = delta_choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            calls += delta.tool_calls or []
            finish = delta_choice.finish_reason or finish
    assert reasoning == choice.message.model_extra["reasoning_content"]
    assert [c.function.arguments for c in calls] == [whole.function.arguments]
    assert finish == "tool_calls"


def test_no_request_left_a_traceback(server) -> None:
    """The bad requests above (and everything else this server took) were answered without an
    exception reaching the log."""
    assert "Traceback" not in server.log_text()
