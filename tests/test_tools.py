"""Tool calling over HTTP with the official client: a model whose chat template presents tools
(Hermes style, <tool_call> blocks), `required` and named choices enforced by the grammar (every
call valid against its function's schema), the call -> tool result -> answer flow, streaming,
the output parsers, and 400s naming `tools` / `tool_choice`."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import jsonschema
import pytest
from helpers import tiny_model
from test_server import spawn_server, wait_healthy

from minisgl.server.tools import ToolCalls, ToolChoice, detect_parser, parse_tool_calls
from minisgl.tokenizer import load_tokenizer

# A chat template of our own in the Hermes / Qwen style: tools listed in the system turn, calls
# as <tool_call> JSON blocks, results as <tool_response> blocks.
TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
""".strip()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny random-weight Qwen3 with the template above, served in float32."""
    folder = tmp_path_factory.mktemp("tool-model")
    for item in tiny_model("qwen3").iterdir():
        (folder / item.name).symlink_to(item)
    tokenizer = load_tokenizer(tiny_model("qwen3"))
    tokenizer.chat_template = TEMPLATE
    for name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(str(folder))
    log = folder / "server.log"
    args = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len", "512"]
    srv = spawn_server(folder, args, log)
    try:
        yield wait_healthy(srv)
    finally:
        srv.stop(signal.SIGKILL if srv.proc.poll() is None else signal.SIGTERM)
        shutil.rmtree(folder, ignore_errors=True)


def assert_valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_valid_calls(client, model) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=4,
        temperature=1.0,
        max_tokens=256,  # two calls a character a token still fit
        seed=3,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid(call)


def test_named_choice_streamed(client, model) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, stream=True, max_tokens=64
    )
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_time"
    jsonschema.validate(json.loads(deltas[0].function.arguments), SCHEMAS["get_time"])


def test_call_result_answer_flow(client, model) -> None:
    # One call (parallel off), and room for its longest form: a random model may spell the
    # city a character (or an escape) a token, which 128 tokens did not always hold.
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    call = first.choices[0].message.tool_calls[0]
    assert_valid(call)
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str) and answer.message.content
    # The result reached the prompt: it is longer than the first turn's by the call and result.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_parsers() -> None:
    choice = ToolChoice(TOOLS, "auto")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, choice, "hermes")
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": 2}
    # Unclosed at the end (EOS came first), two calls, an unknown function ignored.
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert [c["function"]["name"] for c in parse_tool_calls(two, choice, "hermes")[1]] == [
        "get_time",
        "get_weather",
    ]
    assert parse_tool_calls('<tool_call>{"name": "nope"}</tool_call>', choice, "hermes")[1] == []
    assert parse_tool_calls("no calls here", choice, "hermes") == ("no calls here", [])
    llama = '<|python_tag|>{"name": "get_time", "parameters": {"zone": 1}}'
    content, calls = parse_tool_calls(llama, choice, "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": 1}
    assert detect_parser(TEMPLATE) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    # `required`'s array as a grammar lets sampling spell it: whitespace after "[" and around
    # the commas (raw_decode takes none before a value), cut off after its first whole item.
    required = ToolChoice(TOOLS, "required")
    spaced = '[\n  {"name": "get_time", "parameters": {"zone": 3}} ,\r\n\t{"name": "get_weather"'
    content, calls = parse_tool_calls(spaced, required, "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    # A raw control character inside a JSON string (a grammar lets sampling write one): read,
    # and the arguments handed on as strict JSON, for every forced form and Hermes.
    raw = '{"zone": "a\x1eb"}'
    named = parse_tool_calls(raw, ToolChoice(TOOLS, "named", "get_time"), "hermes")[1]
    forced = parse_tool_calls(f'[{{"name": "get_time", "parameters": {raw}}}]', required, "hermes")
    hermes = parse_tool_calls(
        f'<tool_call>{{"name": "get_time", "arguments": {raw}}}</tool_call>', choice, "hermes"
    )
    for calls in (named, forced[1], hermes[1]):
        assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "a\x1eb"}


def test_the_chat_template_is_read_from_the_files_as_the_tokenizer_reads_it(tmp_path) -> None:
    """--tool-call-parser auto reads the template from the folder's files (no tokenizer load):
    chat_template.jinja, or tokenizer_config.json's string or named list, as transformers."""
    from minisgl.server.tools import tool_parser_for
    from minisgl.tokenizer.tokenize import read_chat_template

    model = tiny_model("qwen3")
    assert read_chat_template(model) == load_tokenizer(model).chat_template
    llama = "{{ '<|python_tag|>' }} ipython"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "x"},
                    {"name": "default", "template": llama},
                ]
            }
        )
    )
    assert read_chat_template(tmp_path) == llama
    assert tool_parser_for("auto", tmp_path) == "llama3_json"
    config.write_text(json.dumps({"chat_template": TEMPLATE}))
    assert read_chat_template(tmp_path) == TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(llama)  # the separate file wins, as in HF
    assert read_chat_template(tmp_path) == llama
    config.write_text("{}")
    (tmp_path / "chat_template.jinja").unlink()
    assert read_chat_template(tmp_path) is None and tool_parser_for("auto", tmp_path) == "hermes"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_parameter(server, model, body, param) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model, "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streamed_content_goes_out_until_a_call_may_start(parser) -> None:
    calls = ToolCalls(ToolChoice(TOOLS, "auto"), parser)
    if parser == "hermes":
        pieces = ["Sure, ", "checking <to", "ol_call>", '{"name": "get_time", ', '"arguments": {}}']
        sent = "".join(calls.feed(0, p) for p in pieces)
        assert sent == "Sure, checking "  # the tag's start was held, then never sent
    else:
        pieces = ['{"name": "get_time", ', '"parameters": {"zone": 3}}']
        sent = "".join(calls.feed(0, p) for p in pieces)
        assert sent == ""  # a bare JSON opening: held
    rest, found = calls.finish(0)
    assert rest == "" and [c["function"]["name"] for c in found] == ["get_time"]
    plain = ToolCalls(ToolChoice(TOOLS, "auto"), parser)
    sent = "".join(plain.feed(1, p) for p in ["It is ", "sunny <b>", "today."])
    assert sent + plain.finish(1)[0] == "It is sunny <b>today."
