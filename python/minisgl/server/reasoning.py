"""Reasoning models' thinking, apart from their answer (`--reasoning-parser`, SGLang's and vLLM's
names): the text between <think> and </think> becomes the chat message's `reasoning_content`
(streamed as its own deltas), what follows is its `content` (where tool calls are read)."""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
# Parser name -> whether the output starts inside the thinking: "qwen3" (Qwen3's hybrid models)
# thinks only where the output opens with <think>; "qwen3-thinking" and "deepseek-r1" have
# templates that open it in the prompt, so the output starts thinking (a <think> it repeats is
# dropped) until </think>.
REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be completed next)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ReasoningStream:
    """One choice's output split as it streams into (reasoning, content) pieces; text that may
    be the start of a tag waits for the next piece (or `finish`)."""

    starts_thinking: bool
    mode: str = ""  # "open" (a <think> may come), "thinking", "after" (</think> seen), "content"
    pending: str = ""
    thought: bool = False  # whether any of the output was thinking

    def __post_init__(self) -> None:
        self.mode = "thinking" if self.starts_thinking else "open"
        self.thought = self.starts_thinking
        self._leading = self.starts_thinking  # a forced start drops a <think> it opens with
        self._opened = self.starts_thinking  # just inside <think>

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of output as (reasoning, content) text."""
        buf, self.pending = self.pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self.mode == "open" or self._leading:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.mode, self.thought, self._leading = "thinking", True, False
                    self._opened = True
                    buf = stripped[len(THINK_START) :]
                    continue
                if THINK_START.startswith(stripped):  # whitespace, or a tag's beginning
                    self.pending = buf
                    break
                self._leading = False
                if self.mode == "open":
                    self.mode = "content"
                    continue
            if self.mode == "thinking":
                if self._opened:  # the thinking's leading line breaks belong to the tag
                    buf = buf.lstrip("\r\n")
                    self._opened = not buf
                    if not buf:
                        break
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning.append(buf[:end])
                    self.mode, buf = "after", buf[end + len(THINK_END) :]
                    continue
                keep = _partial_tag(buf, THINK_END)
                reasoning.append(buf[: len(buf) - keep])
                self.pending = buf[len(buf) - keep :]
                break
            if self.mode == "after":  # the answer's leading line breaks belong to neither
                buf = buf.lstrip("\r\n")
                if buf:
                    self.mode = "content"
                continue
            content.append(buf)
            break
        return "".join(reasoning), "".join(content)

    def piece(self, text: str, last: bool) -> tuple[str, str]:
        """`feed`, and with the output's last piece what waited (`finish`) too."""
        reasoning, content = self.feed(text)
        if last:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What waited at the end: thinking cut short stays thinking; anything else content."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.mode == "thinking" else ("", rest)


def split_reasoning(text: str, starts_thinking: bool) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content): None where the model did not think / said
    nothing after thinking."""
    stream = ReasoningStream(starts_thinking)
    reasoning, content = stream.piece(text, last=True)
    if not stream.thought:
        return None, text
    return reasoning, content or None
