"""The docs' examples that are checked without running them: command lines through their
programs' own parsers (the server's; a script's in one DRIVER subprocess), the shell's setup
words, and `LLM(...)` snippets bound to the real signatures."""

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
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from doc_blocks import PLACEHOLDERS, ROOT, Command, simple_commands, strip_prefix, usage_args

PYTHONS = re.compile(r"^(\./)?(\.venv/bin/)?python3?$")
PEER = re.compile(r"^\.peers/([\w.-]+)/bin/")
SHELLS = ("bash", "sh")


# ---------------------------------------------------------------- setup words
def check_assignments(assigned: list[str]) -> None:
    """A MINISGL_ variable an example sets is one the code reads."""
    from minisgl.env import ENV

    known = {variable.name for variable in ENV.variables()}
    for item in assigned:
        name = item.partition("=")[0]
        assert not name.startswith("MINISGL_") or name in known, f"{name}: no such variable"


def check_exists(path: str) -> None:
    assert (ROOT / path).exists(), f"{path} does not exist"


def _setup_cd(args: list[str]) -> None:
    if args and not args[0].startswith(("/", "~", "$")) and args[0] not in PLACEHOLDERS:
        assert (ROOT / args[0]).is_dir(), f"cd {args[0]}: no such folder in the repository"


def _setup_mkdocs(args: list[str]) -> None:
    check_exists("mkdocs.yml")
    assert (ROOT / ".venv" / "bin" / "mkdocs").exists(), "mkdocs is not installed in .venv"


def _setup_pip(args: list[str]) -> None:
    for flag, value in zip(args, args[1:]):
        if flag in ("-e", "--editable", "-r", "--requirement") and not value.startswith("git+"):
            check_exists(value)


def _setup_source(args: list[str]) -> None:
    if args and not args[0].startswith(("/", "~", "$")):
        check_exists(args[0])


def _nothing(args: list[str]) -> None:
    return None


# Shell words that set things up rather than exercise minisgl: the check of what they name.
SETUP_WORDS: dict[str, Callable[[list[str]], None]] = {
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


# ---------------------------------------------------------------- command lines
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
    if first in SHELLS and len(words) > 1 and words[1].endswith(".sh"):
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
    if words[0] in SHELLS:
        return words[2:]
    return words[3:]


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


def check_server_command(words: list[str], tmp: Path) -> None:
    if words[0] in SHELLS:
        check_exists(words[1])
    parse_server_args(usage_args(server_argv(words), tmp))


def check_shell_script(words: list[str]) -> None:
    check_exists(words[1] if words[0] in SHELLS else words[0].removeprefix("./"))


def check_peer(words: list[str]) -> None:
    """A peer's venv is one that a setup script makes (what it runs is left unchecked)."""
    name = PEER.match(words[0]).group(1)  # type: ignore[union-attr]
    setups = [p.read_text() for p in (ROOT / "scripts").glob("setup*.sh")]
    made = re.compile(rf"\.peers/{re.escape(name)}(?![\w.-])")
    assert any(made.search(text) for text in setups), f"no setup script makes .peers/{name}"


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


def script_commands(commands: list[Command], tmp: Path) -> list[tuple[str, str, list[str]]]:
    """Every python-script command among these: (its key, the script, its arguments)."""
    out = []
    for command in commands:
        for i, words in enumerate(simple_commands(command.text)):
            _, words = strip_prefix(words)
            if words and command_kind(words) == "script" and (ROOT / words[1]).is_file():
                out.append((f"{command.where}#{i}", words[1], usage_args(words[2:], tmp)))
    return out


def parse_scripts(commands: list[tuple[str, str, list[str]]]) -> dict[str, str | None]:
    """Each script command's parse, all in one DRIVER subprocess: None, or the script's
    refusal."""
    commands = [*commands, ("canary", "benchmark/offline.py", ["--no-such-flag"])]
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


# ---------------------------------------------------------------- LLM blocks
# Where a python example's minisgl names come from when it leaves out their imports.
IMPLICIT_MODULES = ("minisgl.llm", "minisgl.core")


def _llm_extra_keyword(name: str) -> bool:
    """`LLM(**speculative)` passes SchedulerConfig's speculative_ngram_* settings on."""
    from minisgl.scheduler import SchedulerConfig

    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return name.startswith("speculative_ngram_") and name in fields


# A keyword that lands in a `**kwargs` of a minisgl callable: allowed where a rule says so.
EXTRA_KEYWORDS: dict[str, Callable[[str], bool]] = {"minisgl.llm.llm.LLM": _llm_extra_keyword}


def uses_llm(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Name) and node.id == "LLM" for node in ast.walk(tree))


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
