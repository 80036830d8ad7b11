"""The generated reference pages (docs/reference/): the CLI from the argparse parser, the
environment variables from `minisgl.env`, the endpoints from the FastAPI app's routes.
`python -m minisgl.server.reference` writes them; tests/test_reference.py fails when the
committed pages differ from what this writes."""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

from minisgl.env import ENV

PAGES = ("cli.md", "environment.md", "endpoints.md", "parameters.md")
HEADER = "<!-- Written by `python -m minisgl.server.reference`: edit the source, not this page. -->"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_page() -> str:
    """Every option of `python -m minisgl`, by group: its spellings, default and help."""
    from .args import build_parser

    parser = build_parser()
    lines = [HEADER, "", "# Command line", "", "`python -m minisgl [options]`, by topic.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings != ["-h", "--help"]]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| option | default | what it does |", "|---|---|---|"]
        for action in actions:
            spellings = ", ".join(f"`{s}`" for s in action.option_strings)
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS, False) else f"`{default}`"
            lines.append(f"| {spellings} | {_cell(shown)} | {_cell(action.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def environment_page() -> str:
    """Every MINISGL_* variable: its default and what it does."""
    lines = [HEADER, "", "# Environment variables", "", "| variable | default | what it does |"]
    lines.append("|---|---|---|")
    for var in ENV.variables():
        default = "~/.cache/minisgl" if var.name == "MINISGL_CACHE" else var.default
        lines.append(f"| `{var.name}` | `{default}` | {_cell(var.help)} |")
    return "\n".join(lines) + "\n"


def endpoints_page() -> str:
    """Every HTTP route of the server app: its methods, path and summary (its docstring's
    first line, where it has one)."""
    from fastapi.routing import APIRoute

    from minisgl.message.queue import ZmqAddresses

    from .api_server import create_app
    from .frontend import FrontendManager
    from .metrics import ServerMetrics
    from .state import ServerState

    with tempfile.TemporaryDirectory() as sockets:  # nothing is started: routes only
        metrics = ServerMetrics()
        frontend = FrontendManager(ZmqAddresses(sockets), metrics)
        app = create_app(ServerState("model", "/model", 1, frontend, metrics))
    lines = [HEADER, "", "# HTTP endpoints", "", "| method | path | what it does |"]
    lines.append("|---|---|---|")
    rows = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        doc = (route.endpoint.__doc__ or "").strip().split("\n\n")[0]
        for method in sorted(route.methods or ()):
            rows.append((route.path, method, _cell(doc)))
    for path, method, doc in sorted(rows):
        lines.append(f"| {method} | `{path}` | {doc} |")
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int | None`, `list[str]`, `"float" | "base64"`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


# Integer limits as a reader writes them.
_BOUND_NAMES = {2**31 - 1: "2^31 - 1", 2**63 - 1: "2^63 - 1", -(2**63): "-2^63"}


def _range(metadata: list[object]) -> str:
    bounds = []
    for item in metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                bounds.append(f"{sign} {_BOUND_NAMES.get(value, value)}")
        min_length = getattr(item, "min_length", None)
        if min_length is not None:
            bounds.append(f"length >= {min_length}")
    return ", ".join(bounds)


# Whose API each request field's name and meaning follow, per request body. A field missing
# here fails the page (and tests/test_reference.py), so a new field says whose it is.
_OPENAI_SAMPLING = "model max_tokens temperature top_p seed stop presence_penalty frequency_penalty"
_OPENAI_SAMPLING += " logit_bias n stream stream_options user response_format"
_VLLM_SAMPLING = "top_k min_p stop_token_ids ignore_eos repetition_penalty min_tokens"
_VLLM_SAMPLING += " skip_special_tokens spaces_between_special_tokens include_stop_str_in_output"
_VLLM_SAMPLING += " guided_json guided_regex guided_choice guided_grammar structured_outputs"
_NATIVE = "text input_ids sampling_params stream rid return_logprob logprob_start_len"
_NATIVE += " top_logprobs_num return_text_in_logprobs priority lora_path"
_NATIVE_SAMPLING = "json_schema regex ebnf max_new_tokens min_new_tokens temperature top_p top_k"
_NATIVE_SAMPLING += " min_p frequency_penalty presence_penalty repetition_penalty stop"
_NATIVE_SAMPLING += " stop_token_ids ignore_eos skip_special_tokens spaces_between_special_tokens"
_NATIVE_SAMPLING += " no_stop_trim logit_bias sampling_seed n structural_tag"
FIELD_ORIGINS: dict[str, dict[str, str]] = {
    "POST /v1/chat/completions": {
        "OpenAI": _OPENAI_SAMPLING + " messages max_completion_tokens logprobs top_logprobs tools"
        " tool_choice parallel_tool_calls functions function_call audio modalities prediction"
        " web_search_options",
        "vLLM": _VLLM_SAMPLING + " add_generation_prompt continue_final_message"
        " chat_template_kwargs",
        "SGLang": "priority separate_reasoning",
    },
    "POST /v1/completions": {
        "OpenAI": _OPENAI_SAMPLING + " prompt logprobs echo best_of suffix functions"
        " function_call audio modalities prediction web_search_options",
        "vLLM": _VLLM_SAMPLING + " prompt_logprobs",
        "SGLang": "priority",
    },
    "POST /v1/embeddings": {"OpenAI": "input model encoding_format dimensions user"},
    "POST /v1/rerank": {
        "vLLM": "query documents model top_n return_documents",
        "minisgl": "instruction",
    },
    "POST /v1/score": {"vLLM": "text_1 text_2 model", "minisgl": "instruction"},
    "POST /generate": {
        "SGLang": _NATIVE + " image_data video_data audio_data input_embeds return_hidden_states"
        " custom_logit_processor session_params token_ids_logprob return_routed_experts"
    },
    "/generate's sampling_params": {"SGLang": _NATIVE_SAMPLING},
    "POST /v1/load_lora_adapter": {"vLLM": "lora_name lora_path"},
    "POST /v1/unload_lora_adapter": {"vLLM": "lora_name lora_int_id"},
}

# The fields read from a body's extras (not pydantic fields): their types as a reader writes them.
_EXTRA_TYPES = {
    "response_format": "{type: text | json_object | json_schema, json_schema?}",
    "guided_json": "object | str",
    "guided_regex": "str",
    "guided_choice": "list[str]",
    "guided_grammar": "str (EBNF)",
    "structured_outputs": "{json | regex | choice | grammar}",
}


def _origin(title: str, field: str) -> str:
    for api, names in FIELD_ORIGINS[title].items():
        if field in names.split():
            return api
    raise KeyError(f"{title}: field {field!r} has no origin in reference.FIELD_ORIGINS")


def request_models() -> list[tuple[str, Any]]:
    """(title, pydantic model) of every request body the parameters page lists."""
    from .embeddings import EmbeddingRequest
    from .native_protocol import NativeGenerateRequest, NativeSamplingParams
    from .protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        LoadLoraRequest,
        UnloadLoraRequest,
    )
    from .rerank import RerankRequest, ScoreRequest

    return [
        ("POST /v1/chat/completions", ChatCompletionRequest),
        ("POST /v1/completions", CompletionRequest),
        ("POST /v1/embeddings", EmbeddingRequest),
        ("POST /v1/rerank", RerankRequest),
        ("POST /v1/score", ScoreRequest),
        ("POST /generate", NativeGenerateRequest),
        ("/generate's sampling_params", NativeSamplingParams),
        ("POST /v1/load_lora_adapter", LoadLoraRequest),
        ("POST /v1/unload_lora_adapter", UnloadLoraRequest),
    ]


def parameters_page() -> str:
    """Every request body's fields (the pydantic models the routes parse): type, default,
    range and whose API the name follows. The Messages and Responses bodies, read by their
    modules, are in serving.md."""
    from .structured import STRUCTURED_FIELDS

    lines = [HEADER, "", "# Request parameters", ""]
    lines.append(
        "The fields each request body takes, as the server parses them, and whose API each name"
        " and meaning follow (OpenAI, vLLM or SGLang; minisgl where none has it). A value out"
        " of range is a 400 naming the field; a field not listed is ignored with a warning in"
        " the server's log."
    )
    for title, model in request_models():
        lines += ["", f"## {title}", "", "| field | type | default | range | follows |"]
        lines.append("|---|---|---|---|---|")
        for name, field in model.model_fields.items():
            shown = "required" if field.is_required() else f"`{field.default!r}`"
            kind, bounds = _type_name(field.annotation), _range(list(field.metadata))
            lines.append(
                f"| `{name}` | {_cell(kind)} | {_cell(shown)} | {_cell(bounds)} "
                f"| {_origin(title, name)} |"
            )
        extras: tuple[str, ...] = getattr(model, "handled_extras", ())
        for name in (n for n in extras if n in STRUCTURED_FIELDS):
            kind, api = _cell(_EXTRA_TYPES[name]), _origin(title, name)
            lines.append(f"| `{name}` | {kind} | `None` |  | {api} |")
        refused = [n for n in extras if n not in STRUCTURED_FIELDS]
        for name in refused:
            _origin(title, name)
        if refused:
            names = ", ".join(f"`{n}`" for n in refused)
            lines += ["", f"Refused with a 400 unless off (not served): {names}."]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    return {
        "cli.md": cli_page(),
        "environment.md": environment_page(),
        "endpoints.md": endpoints_page(),
        "parameters.md": parameters_page(),
    }


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/reference")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (folder / name).write_text(text)
        print(f"wrote {folder / name}")


if __name__ == "__main__":
    main()
