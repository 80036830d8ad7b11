"""Structured output (xgrammar): every completion of the default model sampled at temperature 1
parses and validates against its JSON schema, regex and choice constraints hold, and the
OpenAI / vLLM request fields reach the engine over HTTP (bad constraints: a 400 naming them)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
from helpers import assert_all_pages_free, build_llm
from structured_schemas import SCHEMAS
from test_logprobs import tiny_server

from minisgl.core import SamplingParams, StructuredOutput

server = pytest.fixture(scope="module", name="server")(tiny_server)


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
