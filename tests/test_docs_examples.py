"""Every example in README.md and docs/**/*.md does what the docs say: the fenced blocks are
collected at test time (a block added later is covered) and checked by kind, one test per
command or block, named `page:line`.

- Shell blocks (bash, sh, shell, console: only its `$ ` lines): each command, continued lines
  joined, comments dropped. `curl` to localhost is sent (httpx) to the session's default-model
  server with its API key, generation capped at MAX_TOKENS, and must answer 2xx with its
  endpoint's normal JSON (or SSE) shape. `python -m minisgl`, `minisgl` and `bash
  scripts/run.sh` parse their arguments with the server's own `parse_args` and build the
  engine's config from them (its checks; nothing is loaded). `python X.py` scripts (benchmark/,
  scripts/) parse theirs with their own argparse parser in one subprocess, stopped where parsing
  and its checks end (DRIVER), so nothing is measured. `bash scripts/X.sh` and
  `.peers/NAME/bin/...` (a peer venv a setup script makes) must exist; the shell's setup words
  (SETUP_WORDS) check what they name where that means something; a MINISGL_ variable set in
  front of a command must be one minisgl.env reads.
- Python blocks: `openai` clients are run in this process against the server (URL, key and
  model rewritten); `LLM(...)` blocks are checked statically (imports resolve, every call of a
  minisgl name and every method of an `LLM` binds its arguments; no model is loaded).
- JSON blocks must parse; one whose paragraph names its `POST /route` (a request body) is sent
  there like a curl.
- Blocks without a language are shell when they start like a command line (COMMAND_START),
  else ignored: they are output listings and diagrams. `text` blocks are ignored too.

Anything else (a new language, command or python block) fails, so that a new kind of example
forces a decision rather than going unchecked. Left unchecked: what a peer's own command line
(`.peers/...`, `$VLLM_BENCH`) says, a script's checks after its main function's first call
(prefix.py's workload names), the values an `LLM(...)` example passes (only that they bind),
and the output an example prints (only that there is some).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from test_server import API_KEY, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
# Generation is capped at MAX_TOKENS (an example without a limit gets one), to keep time.
MAX_TOKENS = 32
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
LIMIT_FOR = {  # a generating endpoint or openai method -> its limit's name
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "chat.completions.create": "max_tokens",
    "completions.create": "max_tokens",
    "responses.create": "max_output_tokens",
}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
LOCAL_URL = re.compile(r"^(https?://)?(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d+)?")

SHELL, PYTHON, JSON = {"bash", "sh", "shell", "console"}, {"python", "py"}, {"json"}
IGNORED = {"text", "txt"}
COMMAND_START = ("python", "curl", "bash", ".venv/", "minisgl")

# The tables below name an example (curl command, openai block, JSON block) by its page and its
# first line (`docs/lora.md:curl -s localhost:1919/...`), so that edits elsewhere on the page
# leave them valid; a key that names no example fails test_the_tables_name_examples_that_exist.
# Examples that need a server other than the default-model one -> the shared fixture
# (conftest.py) that serves what they need.
SERVER_FOR: dict[str, str] = {}
# Examples that no shared server can answer, so they are only parsed -> why.
PARSE_ONLY: dict[str, str] = {}
# JSON blocks that are fragments by design -> why (they are not parsed).
JSON_FRAGMENTS: dict[str, str] = {}

# Shell words that set things up rather than exercise minisgl: the check of what they name.
SETUP_WORDS: dict[str, Callable[[list[str]], None]] = {}

# Placeholders of the docs' commands and the values that stand in for them ({tmp}: a folder).
PLACEHOLDERS = {
    "PATH": "{tmp}",
    "DIR": "{tmp}",
    "FILE": "{tmp}/file",
    "N": "2",
    "R": "8",
    "KEY": "secret-key",
    "HOST": "127.0.0.1",
    "PORT": "1919",
    "HOST:PORT": "127.0.0.1:29500",
    "NAME": "name",
}
# The key an endpoint's JSON answer has; a stream's events: the key one of them has.
SHAPES = {
    "/v1/chat/completions": "choices",
    "/v1/completions": "choices",
    "/v1/responses": "output",
    "/v1/messages": "content",
    "/v1/messages/count_tokens": "input_tokens",
    "/v1/models": "data",
    "/v1/embeddings": "data",
    "/v1/rerank": "results",
    "/rerank": "results",
    "/v2/rerank": "results",
    "/v1/score": "data",
    "/score": "data",
    "/generate": "text",
    "/tokenize": "tokens",
    "/detokenize": "prompt",
    "/get_model_info": "model_path",
    "/model_info": "model_path",
    "/version": "version",
    "/health": "status",
}
# Endpoints that refuse (400) while requests run: another module's last stream may still be
# finishing on the shared server, so they are tried again for a while.
REFUSED_WHILE_BUSY = ("/flush_cache",)
# Endpoints that answer plain text: what the text starts with.
TEXT_ANSWERS = {"/flush_cache": "cache flushed"}
STREAM_SHAPES = {
    "/v1/chat/completions": "choices",
    "/v1/completions": "choices",
    "/v1/responses": "response",
    "/v1/messages": "message",
    "/generate": "text",
}
# Where a python example's minisgl names come from when it leaves out their imports.
IMPLICIT_MODULES = ("minisgl.llm", "minisgl.core")


def _llm_extra_keyword(name: str) -> bool:
    """`LLM(**speculative)` passes SchedulerConfig's speculative_ngram_* settings on."""
    from minisgl.scheduler import SchedulerConfig

    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return name.startswith("speculative_ngram_") and name in fields


# A keyword that lands in a `**kwargs` of a minisgl callable: allowed where a rule says so.
EXTRA_KEYWORDS: dict[str, Callable[[str], bool]] = {"minisgl.llm.llm.LLM": _llm_extra_keyword}


# ---------------------------------------------------------------- collecting the examples
@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the block's first line, 1-based
    lang: str
    lines: tuple[str, ...]
    before: str = dataclasses.field(default="", compare=False)  # the prose since the last block

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def key(self) -> str:
        return f"{self.page}:{next((x.strip() for x in self.lines if x.strip()), '')}"

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Command:
    """One logical shell line (continuations joined): its simple commands (`;`, `&&`, `|`)."""

    where: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.where.partition(':')[0]}:{self.text.splitlines()[0].strip()}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks(page: Path) -> Iterator[Block]:
    name = page.relative_to(ROOT).as_posix()
    opened: tuple[str, str, str, int] | None = None
    lines: list[str] = []
    prose: list[str] = []
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        if opened is None:
            if m := FENCE.match(raw):
                opened, lines = (m.group(1), m.group(2), m.group(3).lower(), number + 1), []
            else:
                prose.append(raw)
            continue
        indent, fence, lang, start = opened
        if raw.strip() and raw.strip() == fence[0] * len(raw.strip()) and len(raw.strip()) >= 3:
            yield Block(name, start, lang, tuple(lines), "\n".join(prose))
            opened, prose = None, []
        else:
            lines.append(raw[len(indent) :] if raw.startswith(indent) else raw.lstrip())


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in page_blocks(page)]


def kind(block: Block) -> str:
    if block.lang in SHELL:
        return "shell"
    if block.lang in PYTHON:
        return "python"
    if block.lang in JSON:
        return "json"
    if block.lang == "":
        first = next((line.strip() for line in block.lines if line.strip()), "")
        return "shell" if first.startswith(COMMAND_START) else "ignored"
    return "ignored" if block.lang in IGNORED else "unknown"


def logical_lines(block: Block) -> Iterator[Command]:
    """The block's commands: comment lines and a console's output skipped, `$ ` dropped, lines
    continued by a backslash or an open quote joined."""
    text, start = "", 0
    for offset, line in enumerate(block.lines):
        if not text:
            if line.startswith("$ "):
                line = line[2:]
            elif block.lang == "console":
                continue
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = block.line + offset
        text += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(text.replace("\\\n", " "), comments=True)
        except ValueError:  # a quote still open
            continue
        yield Command(f"{block.page}:{start}", text)
        text = ""
    if text:
        yield Command(f"{block.page}:{start}", text)


def simple_commands(text: str) -> list[list[str]]:
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            out.append([])
        else:
            out[-1].append(token)
    return [words for words in out if words]


BLOCKS = all_blocks()
COMMANDS = [cmd for b in BLOCKS if kind(b) == "shell" for cmd in logical_lines(b)]


def ids(items: list) -> list[str]:
    return [item.where for item in items]


# ---------------------------------------------------------------- classifying a command
PYTHONS = re.compile(r"^(\./)?(\.venv/bin/)?python3?$")
PEER = re.compile(r"^\.peers/([\w.-]+)/bin/")
SHELL_KEYWORDS = ("do", "then", "else")


def strip_prefix(words: list[str]) -> tuple[list[str], list[str]]:
    """Shell keywords and `NAME=value` assignments in front of a command, and the command."""
    assigned = []
    while words and words[0] in SHELL_KEYWORDS:
        words = words[1:]
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        assigned.append(words[0])
        words = words[1:]
    return assigned, words


def usage_args(words: list[str], tmp: Path) -> list[str]:
    """A usage line's arguments as a command line: `[--opt X]...` as `--opt X`, placeholders
    as values that stand for them."""
    out = []
    for word in words:
        if word == "...":
            continue
        if word.startswith("[-"):
            word = word[1:]
        word = re.sub(r"\](\.\.\.)?$", "", word) if not word.startswith("[") else word
        value = PLACEHOLDERS.get(word)
        if value is None and "=" in word:
            name, _, rest = word.partition("=")
            if rest in PLACEHOLDERS:
                value = f"{name}={PLACEHOLDERS[rest]}"
        out.append(word if value is None else value.format(tmp=tmp))
    return out


def command_kind(words: list[str]) -> str:
    first = words[0]
    if first == "curl":
        return "curl"
    if first == "minisgl":
        return "server"
    if PYTHONS.match(first) and len(words) > 1:
        if words[1:3] == ["-m", "minisgl"]:
            return "server"
        if words[1].endswith(".py"):
            return "script"
    if first in ("bash", "sh") and len(words) > 1 and words[1].endswith(".sh"):
        return "server" if words[1] == "scripts/run.sh" else "shell-script"
    if first.endswith(".sh"):
        return "shell-script"
    if PEER.match(first):
        return "peer"
    if first in SETUP_WORDS:
        return "setup"
    return "unknown"


def server_argv(words: list[str]) -> list[str]:
    if words[0] == "minisgl":
        return words[1:]
    if words[0] in ("bash", "sh"):
        return words[2:]
    return words[3:]


# ---------------------------------------------------------------- setup words
def check_assignments(assigned: list[str]) -> None:
    """A MINISGL_ variable an example sets is one the code reads."""
    from minisgl.env import ENV

    known = {variable.name for variable in ENV.variables()}
    for item in assigned:
        name = item.partition("=")[0]
        assert not name.startswith("MINISGL_") or name in known, f"{name}: no such variable"


def _exists(path: str) -> None:
    assert (ROOT / path).exists(), f"{path} does not exist"


def _setup_cd(args: list[str]) -> None:
    if args and not args[0].startswith(("/", "~", "$")) and args[0] not in PLACEHOLDERS:
        assert (ROOT / args[0]).is_dir(), f"cd {args[0]}: no such folder in the repository"


def _setup_mkdocs(args: list[str]) -> None:
    _exists("mkdocs.yml")
    assert (ROOT / ".venv" / "bin" / "mkdocs").exists(), "mkdocs is not installed in .venv"


def _setup_pip(args: list[str]) -> None:
    for flag, value in zip(args, args[1:]):
        if flag in ("-e", "--editable", "-r", "--requirement") and not value.startswith("git+"):
            _exists(value)


def _setup_source(args: list[str]) -> None:
    if args and not args[0].startswith(("/", "~", "$")):
        _exists(args[0])


def _nothing(args: list[str]) -> None:
    return None


SETUP_WORDS.update(
    {
        "cd": _setup_cd,
        "mkdocs": _setup_mkdocs,
        "pip": _setup_pip,
        "source": _setup_source,
        ".": _setup_source,
        "export": check_assignments,
        "git": _nothing,  # a clone or checkout names nothing here
        "set": _nothing,  # shell options or positional parameters
        "for": _nothing,  # a loop's header: its body's commands are checked one by one
        "done": _nothing,
    }
)


# ---------------------------------------------------------------- the server's side
def served(url: str) -> list[str]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return [m["id"] for m in httpx.get(f"{url}/v1/models", headers=headers).json()["data"]]


def rewrite_body(body: object, names: list[str], route: str) -> object:
    """The docs' request as the test server takes it: a model it serves, few tokens."""
    if isinstance(body, list):
        return [rewrite_body(item, names, route) for item in body]
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str) and body["model"] not in names:
        body["model"] = names[0]
    limits = {key: body[key] for key in TOKEN_LIMITS if key in body}
    if route in LIMIT_FOR and not limits:
        body[LIMIT_FOR[route]] = MAX_TOKENS
    if route == "/generate":
        params = dict(body.get("sampling_params") or {})
        params["max_new_tokens"] = min(params.get("max_new_tokens", MAX_TOKENS), MAX_TOKENS)
        body["sampling_params"] = params
    for key, value in limits.items():
        if isinstance(value, int) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    return body


@dataclasses.dataclass
class CurlRequest:
    method: str
    url: str
    headers: dict[str, str]
    data: str | None


CURL_FLAGS = set("sSNfLiv")
CURL_LONG_FLAGS = {"--silent", "--show-error", "--no-buffer", "--fail", "--location", "--include"}


def parse_curl(words: list[str]) -> CurlRequest:
    method, url, headers, data = None, None, {}, None
    rest = iter(words[1:])
    for word in rest:
        if word in ("-X", "--request"):
            method = next(rest)
        elif word in ("-H", "--header"):
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word in ("-d", "--data", "--data-raw", "--data-binary", "--json"):
            data = next(rest)
            assert not data.startswith("@"), f"curl {word} @file is not supported here"
            if word == "--json":
                headers.setdefault("Content-Type", "application/json")
        elif word in CURL_LONG_FLAGS or re.fullmatch(rf"-[{''.join(CURL_FLAGS)}]+", word):
            continue
        elif word.startswith("-"):
            raise AssertionError(f"curl option {word} is not handled by this test: add it")
        else:
            assert url is None, f"two URLs: {url} and {word}"
            url = word
    assert url is not None, "curl without a URL"
    return CurlRequest(method or ("POST" if data is not None else "GET"), url, headers, data)


def local_path(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    assert parts.hostname in LOCAL_HOSTS, f"{url}: not the local server"
    return parts.path + (f"?{parts.query}" if parts.query else "")


def check_answer(path: str, response: httpx.Response, stream: bool) -> None:
    """2xx, and the endpoint's normal answer: JSON with its key (each item of a batch), or a
    stream of JSON events one of which has its key."""
    route = path.partition("?")[0]
    assert 200 <= response.status_code < 300, f"{response.status_code}: {response.text[:500]}"
    if route in TEXT_ANSWERS:
        assert response.text.startswith(TEXT_ANSWERS[route]), f"{route}: {response.text[:500]}"
        return
    assert route in SHAPES, f"no known answer shape for {route}: add it to SHAPES"
    if not stream:
        body, key = response.json(), SHAPES[route]
        items = body if isinstance(body, list) else [body]
        assert all(key in item for item in items), f"{route}: no {key!r} in {str(body)[:500]}"
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    events = [json.loads(item) for item in data if item != "[DONE]"]
    assert events, f"{route}: an empty stream"
    key = STREAM_SHAPES.get(route)
    assert key is None or any(key in event for event in events), f"{route}: no event has {key}"


def ignored_fields(endpoint: str, body: object) -> list[str]:
    """The body's fields the server reads nowhere (it names them in a WARNING and goes on);
    a field parsed on its own ("/generate's sampling_params") too."""
    from minisgl.server.reference import request_models

    if not isinstance(body, dict):
        return []
    route, out = endpoint.partition(" ")[2], []
    for title, model in request_models():
        if title == endpoint:
            value, prefix = body, ""
        elif title.startswith(f"{route}'s "):
            field = title.removeprefix(f"{route}'s ")
            value, prefix = body.get(field), f"{field}."
        else:
            continue
        if isinstance(value, dict):
            with contextlib.suppress(ValueError):  # a refused value: the answer says why
                out += model.model_validate(value).ignored_fields(prefix)
    return out


def send(server_url: str, method: str, path: str, headers: dict, content: str | None) -> None:
    """The docs' request, as the test server takes it, gets its endpoint's normal answer."""
    headers = httpx.Headers(headers)
    headers["Authorization"] = f"Bearer {API_KEY}"
    stream, ignored = False, []
    if content is not None:
        headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # curl's -d
        with contextlib.suppress(ValueError):
            route = path.partition("?")[0]
            body = rewrite_body(json.loads(content), served(server_url), route)
            stream = isinstance(body, dict) and body.get("stream") is True
            content = json.dumps(body)
            ignored = ignored_fields(f"{method} {route}", body)
    for _ in range(40):
        response = httpx.request(
            method, server_url + path, headers=headers, content=content, timeout=120
        )
        if not (path.startswith(REFUSED_WHILE_BUSY) and response.status_code == 400):
            break
        time.sleep(0.25)
    check_answer(path, response, stream)
    assert not ignored, f"{path}: the server ignores {ignored} (a WARNING in its log)"


def parse_server_args(argv: list[str]) -> None:
    """What `python -m minisgl` does before it loads anything: parse (and check) the command
    line, build the engine's config (which checks the settings together)."""
    from minisgl.server.args import parse_args
    from minisgl.server.launch import build_scheduler_config

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"python -m minisgl refuses {argv}: {err.getvalue()}"
        return
    try:
        build_scheduler_config(args, args.model_path or "default-model")
    except ValueError as e:
        raise AssertionError(f"python -m minisgl {argv}: the engine refuses them: {e}") from None


# ---------------------------------------------------------------- scripts, parsed in one process
# Runs each script as `__main__` with argparse patched: after a successful parse the script runs
# on until its main function (what its top level called) calls anything but argparse (p.error)
# or a comprehension, or returns. So the checks that follow parsing (in the script's parse
# function, or inline before main's first call) count, and nothing heavy runs.
DRIVER = r"""
import argparse, contextlib, io, json, os, runpy, sys
import torch
torch.set_num_threads(2)

class Parsed(BaseException):
    pass

script = None
original = argparse.ArgumentParser.parse_args

def stop_where_parsing_ends(frame):
    chain = []
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_code.co_filename == script
    ):
        chain.append(frame)
        frame = frame.f_back
    if frame is None:
        raise Parsed
    top = chain[-1] if chain else frame
    raised = []

    def on_return(f, event, arg):
        if event == "exception":
            raised.append(arg[0])
        elif event == "return" and not (arg is None and raised):
            raise Parsed
        return on_return

    def on_call(f, event, arg):
        code = f.f_code
        if f.f_back is top and code.co_filename != argparse.__file__ and code.co_name[0] != "<":
            raise Parsed

    top.f_trace_lines = False
    top.f_trace = on_return
    sys.settrace(on_call)


def parse_args(self, *args, **kwargs):
    namespace = original(self, *args, **kwargs)
    stop_where_parsing_ends(sys._getframe(1))
    return namespace

argparse.ArgumentParser.parse_args = parse_args
results = {}
for key, path, argv in json.load(sys.stdin):
    script = os.path.abspath(path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(script))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        results[key] = "ran to its end without parsing arguments: " + out.getvalue()[-1000:]
    except Parsed:
        results[key] = None
    except SystemExit as e:
        ok = e.code in (0, None) and "usage:" in out.getvalue()
        results[key] = None if ok else f"exit {e.code}: {out.getvalue()[-1000:]}"
    except BaseException as e:
        results[key] = f"{type(e).__name__}: {e}\n{out.getvalue()[-1000:]}"
    finally:
        sys.settrace(None)
        sys.path.remove(os.path.dirname(script))
print(json.dumps(results))
"""


def script_commands(tmp: Path) -> list[tuple[str, str, list[str]]]:
    """Every python-script command of the docs: (its key, the script, its arguments)."""
    out = []
    for command in COMMANDS:
        for i, words in enumerate(simple_commands(command.text)):
            _, words = strip_prefix(words)
            if words and command_kind(words) == "script" and (ROOT / words[1]).is_file():
                out.append((f"{command.where}#{i}", words[1], usage_args(words[2:], tmp)))
    return out


@pytest.fixture(scope="module")
def script_parses(tmp_path_factory) -> dict[str, str | None]:
    """Each script command's parse: None, or the script's refusal."""
    tmp = tmp_path_factory.mktemp("docs-placeholder")
    commands = [*script_commands(tmp), ("canary", "benchmark/offline.py", ["--no-such-flag"])]
    env = {**os.environ, "MINISGL_NUM_THREADS": "2", "MINISGL_LOG_LEVEL": "WARNING"}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parses = json.loads(result.stdout.splitlines()[-1])
    assert "unrecognized arguments" in (parses.pop("canary") or ""), "the driver accepts anything"
    return parses


# ---------------------------------------------------------------- python blocks
class ToTestServer(ast.NodeTransformer):
    """An openai example aimed at the test server: its URL, key, a model it serves, few
    tokens."""

    def __init__(self, url: str, names: list[str]) -> None:
        self.url, self.names = url, names

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and LOCAL_URL.match(node.value):
            return ast.Constant(LOCAL_URL.sub(self.url, node.value))
        return node

    def visit_keyword(self, node: ast.keyword) -> ast.AST:
        value = node.value
        if node.arg == "api_key":
            node.value = ast.Constant(API_KEY)
        elif node.arg == "model" and isinstance(value, ast.Constant):
            if value.value not in self.names:
                node.value = ast.Constant(self.names[0])
        elif node.arg in TOKEN_LIMITS and isinstance(value, ast.Constant):
            if isinstance(value.value, int) and value.value > MAX_TOKENS:
                node.value = ast.Constant(MAX_TOKENS)
        else:
            self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        method = ast.unparse(node.func)
        limit = next((v for k, v in LIMIT_FOR.items() if method.endswith(f".{k}")), None)
        if limit and not any(k.arg in TOKEN_LIMITS for k in node.keywords):
            node.keywords.append(ast.keyword(limit, ast.Constant(MAX_TOKENS)))
        return node


def imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def uses_openai(tree: ast.AST) -> bool:
    return any(name.split(".")[0] == "openai" for name in imports(tree))


def uses_llm(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Name) and node.id == "LLM" for node in ast.walk(tree))


def run_openai_block(block: Block, tree: ast.Module, url: str, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
    tree = ast.fix_missing_locations(ToTestServer(url, served(url)).visit(tree))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, block.where, "exec"), {"__name__": "__main__"})
    assert out.getvalue().strip(), f"{block.where} printed nothing"


def bind(obj: Callable, call: ast.Call, what: str, method: bool = False) -> None:
    """The call's arguments bind to the real signature; a keyword that lands in `**kwargs`
    needs an EXTRA_KEYWORDS rule."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return
    signature = inspect.signature(obj)
    args = [None] * (len(call.args) + method)
    try:
        bound = signature.bind(*args, **{k.arg: None for k in call.keywords if k.arg})
    except TypeError as e:
        raise AssertionError(f"{what}: {e}") from None
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD and param.name in bound.arguments:
            name = f"{obj.__module__}.{obj.__qualname__}".removesuffix(".__init__")
            allowed = EXTRA_KEYWORDS.get(name, lambda k: False)
            wrong = [k for k in bound.arguments[param.name] if not allowed(k)]
            assert not wrong, f"{what}: no such keyword argument {wrong}"


def check_offline_block(tree: ast.Module, where: str) -> None:
    """Imports resolve; calls of minisgl names and methods of their instances bind."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minisgl"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
    assigned = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in names and node.id not in assigned:
            for module in IMPLICIT_MODULES:  # a snippet may leave out the offline page's imports
                if hasattr(mod := importlib.import_module(module), node.id):
                    names[node.id] = getattr(mod, node.id)
                    break
    instances: dict[str, type] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and inspect.isclass(names.get(node.value.func.id))
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    instances[target.id] = names[node.value.func.id]  # type: ignore[assignment]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and callable(names.get(func.id)):
            bind(names[func.id], node, f"{where}: {func.id}(...)")  # type: ignore[arg-type]
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in instances
        ):
            cls = instances[func.value.id]
            what = f"{where}: {func.value.id}.{func.attr}(...)"
            assert hasattr(cls, func.attr), f"{what}: {cls.__name__} has no {func.attr}"
            bind(getattr(cls, func.attr), node, what, method=True)


# ---------------------------------------------------------------- the tests
def server_for(key: str, request) -> str:
    return wait_healthy(request.getfixturevalue(SERVER_FOR.get(key, "smollm2_server"))).url


def check_command(words: list[str], command: Command, i: int, tmp: Path, request) -> None:
    assigned, words = strip_prefix(words)
    check_assignments(assigned)
    if not words:
        return
    match command_kind(words):
        case "curl":
            curl = parse_curl(words)
            path = local_path(curl.url)
            if command.key in PARSE_ONLY:
                json.loads(curl.data or "{}")
            else:
                send(server_for(command.key, request), curl.method, path, curl.headers, curl.data)
        case "server":
            if words[0] in ("bash", "sh"):
                _exists(words[1])
            parse_server_args(usage_args(server_argv(words), tmp))
        case "script":
            _exists(words[1])
            error = request.getfixturevalue("script_parses")[f"{command.where}#{i}"]
            assert error is None, f"{words[1]} refuses its arguments: {error}"
        case "shell-script":
            _exists(words[1] if words[0] in ("bash", "sh") else words[0].removeprefix("./"))
        case "peer":
            name = PEER.match(words[0]).group(1)  # type: ignore[union-attr]
            setups = [p.read_text() for p in (ROOT / "scripts").glob("setup*.sh")]
            made = re.compile(rf"\.peers/{re.escape(name)}(?![\w.-])")
            assert any(made.search(text) for text in setups), f"no setup script makes .peers/{name}"
        case "setup":
            SETUP_WORDS[words[0]](words[1:])
        case _:
            raise AssertionError(f"unrecognized example command: {shlex.join(words)}")


@pytest.mark.parametrize("command", COMMANDS, ids=ids(COMMANDS))
def test_shell_command(command: Command, tmp_path: Path, request) -> None:
    """Each command of a shell block runs (curl), or parses with its program's own parser."""
    commands = simple_commands(command.text)
    assert commands, f"{command.where}: no command in {command.text!r}"
    for i, words in enumerate(commands):
        try:
            check_command(words, command, i, tmp_path, request)
        except AssertionError as e:
            raise AssertionError(f"at {command.where}: {shlex.join(words)}\n{e}") from None


PYTHON_BLOCKS = [b for b in BLOCKS if kind(b) == "python"]
JSON_BLOCKS = [b for b in BLOCKS if kind(b) == "json"]
POSTED = re.compile(r"`POST (/[\w/]+)`")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=ids(PYTHON_BLOCKS))
def test_python_block(block: Block, request, monkeypatch) -> None:
    """An openai example runs against the server; an `LLM` example binds to the real API."""
    tree = ast.parse(block.text, block.where)
    if uses_openai(tree):
        if block.key not in PARSE_ONLY:
            run_openai_block(block, tree, server_for(block.key, request), monkeypatch)
    elif uses_llm(tree):
        check_offline_block(tree, block.where)
    else:
        raise AssertionError(f"unrecognized python example at {block.where}: add a rule for it")


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=ids(JSON_BLOCKS))
def test_json_block(block: Block, request) -> None:
    """A JSON block is JSON; a request body whose paragraph names its `POST /route` gets that
    endpoint's normal answer."""
    if block.key in JSON_FRAGMENTS:
        return
    json.loads(block.text)
    routes = POSTED.findall(block.before.strip().split("\n\n")[-1])
    if routes and block.key not in PARSE_ONLY:
        headers = {"Content-Type": "application/json"}
        send(server_for(block.key, request), "POST", routes[-1], headers, block.text)


def test_every_block_is_of_a_known_kind() -> None:
    """A block of a language this module does not know fails until it gets a rule."""
    unknown = [f"{b.where} ({b.lang})" for b in BLOCKS if kind(b) == "unknown"]
    assert not unknown, f"blocks of an unhandled language: {unknown}"
    assert COMMANDS and PYTHON_BLOCKS, "no examples found: is the fence parsing broken?"


def test_the_tables_name_examples_that_exist() -> None:
    """SERVER_FOR, PARSE_ONLY and JSON_FRAGMENTS name examples that are still in the docs."""
    examples = {c.key for c in COMMANDS} | {b.key for b in PYTHON_BLOCKS + JSON_BLOCKS}
    stale = [key for key in [*SERVER_FOR, *PARSE_ONLY, *JSON_FRAGMENTS] if key not in examples]
    assert not stale, f"the tables name examples no longer in the docs: {stale}"
    assert set(SERVER_FOR.values()) <= {"smollm2_server", "tiny_qwen3_server"}


def _parse_error(argv: list[str]) -> str:
    try:
        parse_server_args(argv)
    except AssertionError as e:
        return str(e)
    return ""


def test_the_checks_refuse_what_is_wrong(tmp_path: Path) -> None:
    """An unknown flag, a bad choice, a bad value and settings the engine refuses together fail
    the server check; a new kind of command fails as unrecognized."""
    assert "unrecognized arguments" in _parse_error(["--no-such-flag"])
    assert "invalid choice" in _parse_error(["--speculative-algorithm", "EAGLE9"])
    assert "invalid int value" in _parse_error(["--port", "N1"])
    assert "needs dist_init_addr" in _parse_error(["--tp", "2", "--nnodes", "2"])
    with pytest.raises(AssertionError, match="unrecognized example command"):
        check_command(["vllm", "serve"], Command("x.md:1", "vllm serve"), 0, tmp_path, None)
