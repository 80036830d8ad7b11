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
import json
import re
import shlex
from pathlib import Path

import pytest

# Before the helpers are imported: their failed asserts then carry pytest's explanation, as a
# test module's do (and theirs did when they were part of this file).
pytest.register_assert_rewrite("doc_blocks", "doc_dry_runs", "doc_requests")

from doc_blocks import (  # noqa: E402
    Block,
    Command,
    all_blocks,
    kind,
    logical_lines,
    simple_commands,
    strip_prefix,
)
from doc_dry_runs import (  # noqa: E402
    SETUP_WORDS,
    check_assignments,
    check_exists,
    check_offline_block,
    check_peer,
    check_server_command,
    check_shell_script,
    command_kind,
    parse_scripts,
    parse_server_args,
    script_commands,
    uses_llm,
)
from doc_requests import local_path, parse_curl, run_openai_block, send, uses_openai  # noqa: E402
from test_server import wait_healthy  # noqa: E402

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

BLOCKS = all_blocks()
COMMANDS = [cmd for b in BLOCKS if kind(b) == "shell" for cmd in logical_lines(b)]
PYTHON_BLOCKS = [b for b in BLOCKS if kind(b) == "python"]
JSON_BLOCKS = [b for b in BLOCKS if kind(b) == "json"]
POSTED = re.compile(r"`POST (/[\w/]+)`")


def ids(items: list) -> list[str]:
    return [item.where for item in items]


@pytest.fixture(scope="module")
def script_parses(tmp_path_factory) -> dict[str, str | None]:
    """Each script command's parse: None, or the script's refusal."""
    tmp = tmp_path_factory.mktemp("docs-placeholder")
    return parse_scripts(script_commands(COMMANDS, tmp))


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
            check_server_command(words, tmp)
        case "script":
            check_exists(words[1])
            error = request.getfixturevalue("script_parses")[f"{command.where}#{i}"]
            assert error is None, f"{words[1]} refuses its arguments: {error}"
        case "shell-script":
            check_shell_script(words)
        case "peer":
            check_peer(words)
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
