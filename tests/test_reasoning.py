"""The reasoning parsers (server/reasoning.py): a whole output and the same output streamed in
pieces cut anywhere (inside the tags too) split into the same thinking and content."""

from __future__ import annotations

import pytest

from minisgl.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning

CASES = [
    # (output, starts thinking, reasoning_content, content)
    ("<think>\nplan it</think>\n\nThe answer.", False, "plan it", "The answer."),
    ("  <think>a < b </thi</think>ok", False, "a < b </thi", "ok"),
    ("No thinking here.", False, None, "No thinking here."),
    ("<thinking is not a tag", False, None, "<thinking is not a tag"),
    ("<think>cut short by max_tokens", False, "cut short by max_tokens", None),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("\nfrom the prompt's <think></think>\nAnswer", True, "from the prompt's <think>", "Answer"),
    ("<think>repeated opening</think>x", True, "repeated opening", "x"),
    ("all thinking", True, "all thinking", None),
]


def streamed(text: str, starts_thinking: bool, cuts: list[int]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(starts_thinking), "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        piece_reasoning, piece_content = stream.feed(text[start:end])
        reasoning, content = reasoning + piece_reasoning, content + piece_content
    last_reasoning, last_content = stream.finish()
    return reasoning + last_reasoning, content + last_content


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), CASES)
def test_whole_and_streamed_outputs_split_alike(text, starts, reasoning, content) -> None:
    assert split_reasoning(text, starts) == (reasoning, content)
    want = (reasoning or "", content or "")
    for cut in range(len(text) + 1):  # two pieces cut at every place
        assert streamed(text, starts, [cut]) == want, cut
    assert streamed(text, starts, list(range(1, len(text)))) == want  # a character a piece


def test_parsers_by_name() -> None:
    assert REASONING_PARSERS == {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}
