"""Anthropic's Messages API over HTTP (server/anthropic.py): a request means the chat request it
translates to (the same greedy text), whole or streamed as Anthropic's events, with stop
sequences, tools (tool_use blocks, tool_result turns), token counting, Anthropic's error shape
and its x-api-key header."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_server import API_KEY, wait_healthy

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = {
    "system": "You are terse.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
}


@pytest.fixture(scope="module")
def url(tiny_qwen3_server) -> str:
    return wait_healthy(tiny_qwen3_server).url


def post(url: str, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def events(response: httpx.Response) -> list[dict]:
    """The stream's events, their `event:` name checked against the data's type."""
    out = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        out.append(event)
    return out


def test_a_message_is_the_chat_request_it_means_whole_and_streamed(url) -> None:
    body = {**ASK, "max_tokens": 12, "temperature": 0}
    reply = post(url, "/v1/messages", body)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert message["id"].startswith("msg_") and message["stop_sequence"] is None
    text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    chat = post(
        url,
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."},
            ],
            "max_tokens": 12,
            "temperature": 0,
        },
    ).json()
    assert text == chat["choices"][0]["message"]["content"]
    finish = chat["choices"][0]["finish_reason"]
    assert message["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[finish]
    usage = message["usage"]
    prompt = chat["usage"]["prompt_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    count = post(url, "/v1/messages/count_tokens", ASK).json()
    assert count == {"input_tokens": prompt}

    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}) as streamed:
        streamed.read()
    seen = events(streamed)
    kinds = [e["type"] for e in seen]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    deltas = [e["delta"]["text"] for e in seen if e["type"] == "content_block_delta"]
    assert "".join(deltas) == text
    assert seen[-2]["delta"]["stop_reason"] == message["stop_reason"]
    assert seen[-2]["usage"]["output_tokens"] == usage["output_tokens"]

    if len(text) > 4:  # a stop sequence the greedy text reaches
        stop = text[2:4]
        stopped = post(url, "/v1/messages", {**body, "stop_sequences": [stop]}).json()
        assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
        kept = "".join(b["text"] for b in stopped["content"] if b["type"] == "text")
        assert kept == text[: text.index(stop)]


def test_tools_give_tool_use_blocks_and_take_tool_results(url) -> None:
    # Room for the call spelled a character (or an escape) a token, as a random model may.
    body = {**ASK, "max_tokens": 200, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    message = post(url, "/v1/messages", body).json()
    assert message["stop_reason"] == "tool_use", message
    use = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use and use[0]["name"] == "get_weather" and use[0]["id"].startswith("toolu_")
    jsonschema.validate(use[0]["input"], WEATHER["input_schema"])
    turns = [
        *ASK["messages"],
        {"role": "assistant", "content": message["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use[0]["id"], "content": "sunny"},
                {"type": "text", "text": "And so?"},
            ],
        },
    ]
    follow = post(url, "/v1/messages", {"messages": turns, "max_tokens": 4, "tools": [WEATHER]})
    assert follow.status_code == 200 and follow.json()["content"], follow.text
    named = {**body, "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=named) as streamed:
        streamed.read()
    seen = events(streamed)
    start = next(e for e in seen if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use"
    partial = "".join(
        e["delta"]["partial_json"]
        for e in seen
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    jsonschema.validate(json.loads(partial), WEATHER["input_schema"])
    assert seen[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": ASK["messages"]}, "max_tokens"),
        ({**ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}, "role"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({**ASK, "max_tokens": 4, "tool_choice": {"type": "maybe"}, "tools": []}, "tool_choice"),
        ({**ASK, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking"),
    ],
)
def test_bad_requests_get_anthropics_error_shape(url, body, named) -> None:
    reply = post(url, "/v1/messages", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_x_api_key_is_accepted_beside_bearer(smollm2_server) -> None:
    server = wait_healthy(smollm2_server)
    body = {**ASK, "max_tokens": 2}
    assert post(server.url, "/v1/messages", body, **{"x-api-key": API_KEY}).status_code == 200
    headers = {"authorization": f"Bearer {API_KEY}"}
    assert post(server.url, "/v1/messages", body, **headers).status_code == 200
    refused = post(server.url, "/v1/messages", body, **{"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"


def test_the_official_client_works_unmodified(url) -> None:
    """Anthropic's own client: create, stream (its event accumulation), count_tokens, a tool
    round trip, thinking blocks (the output held to a thinking form by a regex) with a tool call
    after them, and errors as its exception types."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0.0}  # (this client version sends no temperature of its own)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    ask = dict(model=model, max_tokens=12, **ASK)
    message = client.messages.create(**ask, extra_body=greedy)
    whole = "".join(b.text for b in message.content if b.type == "text")
    with client.messages.stream(**ask, extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole and final.stop_reason == message.stop_reason
    count = client.messages.count_tokens(model=model, **ASK)
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

    think = r"<think>\n[a-z]{3,8}\n</think>\n\n"
    call = think + (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,5}"\}\}'
        r"\n</tool_call>"
    )
    used = client.messages.create(
        **{**ask, "max_tokens": 160},
        tools=[WEATHER],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={**greedy, "guided_regex": call},
    )
    assert [b.type for b in used.content] == ["thinking", "tool_use"], used.content
    assert used.stop_reason == "tool_use" and used.content[1].name == "get_weather"
    with client.messages.stream(
        **{**ask, "max_tokens": 160}, tools=[WEATHER], extra_body={**greedy, "guided_regex": call}
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == used.content[1].input
    result = {"type": "tool_result", "tool_use_id": used.content[1].id, "content": "sunny"}
    turns = [
        *ASK["messages"],
        {"role": "assistant", "content": used.content},
        {"role": "user", "content": [result]},
    ]
    follow = client.messages.create(
        **{**ask, "max_tokens": 4, "messages": turns}, extra_body=greedy, tools=[WEATHER]
    )
    assert follow.content and follow.usage.cache_read_input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(**{**ask, "max_tokens": 0}, extra_body=greedy)
    assert error.value.body["error"]["type"] == "invalid_request_error"
