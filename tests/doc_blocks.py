"""Finding the docs' examples: the fenced blocks of README.md and docs/**/*.md and their kinds,
and a shell block's commands as words, with a usage line's placeholders given values."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHELL, PYTHON, JSON = {"bash", "sh", "shell", "console"}, {"python", "py"}, {"json"}
IGNORED = {"text", "txt"}
COMMAND_START = ("python", "curl", "bash", ".venv/", "minisgl")
SHELL_KEYWORDS = ("do", "then", "else")

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
    def first(self) -> str:
        """The first line that is not blank, stripped."""
        return next((x.strip() for x in self.lines if x.strip()), "")

    @property
    def key(self) -> str:
        return f"{self.page}:{self.first}"

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
        return "shell" if block.first.startswith(COMMAND_START) else "ignored"
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
