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


def _range(metadata: list[object]) -> str:
    bounds = []
    for item in metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
        min_length = getattr(item, "min_length", None)
        if min_length is not None:
            bounds.append(f"length >= {min_length}")
    return ", ".join(bounds)


def parameters_page() -> str:
    """Every request body's fields (the pydantic models the routes parse): type, default and
    range. The Messages and Responses bodies, read by their modules, are in serving.md."""
    from pydantic import BaseModel

    from .embeddings import EmbeddingRequest
    from .native_protocol import NativeGenerateRequest, NativeSamplingParams
    from .protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        LoadLoraRequest,
        UnloadLoraRequest,
    )
    from .rerank import RerankRequest, ScoreRequest

    models: list[tuple[str, type[BaseModel]]] = [
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
    lines = [HEADER, "", "# Request parameters", ""]
    lines.append("The fields each request body takes, as the server parses them.")
    for title, model in models:
        lines += ["", f"## {title}", "", "| field | type | default | range |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            shown = "required" if field.is_required() else f"`{field.default!r}`"
            kind, bounds = _type_name(field.annotation), _range(list(field.metadata))
            lines.append(f"| `{name}` | {_cell(kind)} | {_cell(shown)} | {_cell(bounds)} |")
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
