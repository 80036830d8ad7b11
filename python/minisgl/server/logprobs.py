"""Log-probabilities in OpenAI's response shapes, from the detokenizer's entries ([token id,
text, logprob, [[id, text, logprob], ...]] per token; see OutputMsg.logprobs): chat's
`logprobs.content[]`, the legacy completions' `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset`, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from minisgl.message import OutputMsg

# JSON has no infinities: a token the model rules out reports vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _chat_item(token_text: str, logprob: float) -> dict[str, Any]:
    return {"token": token_text, "logprob": _value(logprob), "bytes": list(token_text.encode())}


def chat_logprobs(entries: list[list[Any]]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one streamed chunk's tokens)."""
    content = []
    for _, text, logprob, top in entries:
        item = _chat_item(text, logprob)
        item["top_logprobs"] = [_chat_item(alt_text, alt_lp) for _, alt_text, alt_lp in top]
        content.append(item)
    return {"content": content}


LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass
class CompletionLogprobs:
    """The legacy completions' `logprobs` of one choice, built a piece at a time (the text
    offsets run on across the pieces of a stream)."""

    offset: int = 0  # characters of the choice's text before the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entries: list[list[Any]]) -> None:
        """Append tokens' entries (a prompt's first token has logprob None)."""
        for _, text, logprob, top in entries:
            if logprob is None:
                self._append(text, None, None)
                continue
            # The alternatives, and the token itself (OpenAI: up to logprobs + 1 of them).
            alternatives = {alt_text: _value(alt_lp) for _, alt_text, alt_lp in top}
            alternatives.setdefault(text, _value(logprob))
            self._append(text, _value(logprob), alternatives)

    def _append(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def take(self) -> dict[str, list[Any]]:
        """The body of what was added since the last take, and start afresh (a stream's next
        piece continues the offsets)."""
        body = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def prompt_logprobs_body(entries: list[list[Any]]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    decoded_token}} for the prompt's token and its most likely alternatives."""
    body: list[dict[str, Any] | None] = []
    for token, text, logprob, top in entries:
        if logprob is None:
            body.append(None)
            continue
        position = {str(token): {"logprob": _value(logprob), "decoded_token": text}}
        for alt, alt_text, alt_lp in top:
            position.setdefault(str(alt), {"logprob": _value(alt_lp), "decoded_token": alt_text})
        body.append(position)
    return body


class ChoiceLogprobs:
    """The log-probabilities of every choice of one request, as its endpoint reports them:
    per streamed piece (`piece`) and whole (`whole`); `prompt` asks for vLLM's
    `prompt_logprobs` field, echo puts the prompt's tokens first (legacy completions)."""

    def __init__(self, chat: bool, choices: int, prompt: bool, echo: bool) -> None:
        self.chat, self.prompt, self.echo = chat, prompt, echo
        self._content: list[list[dict[str, Any]]] = [[] for _ in range(choices)]
        self._legacy = [CompletionLogprobs() for _ in range(choices)]
        self._pieces: list[list[dict[str, Any]]] = [[] for _ in range(choices)]
        self._prompt: list[list[dict[str, Any] | None] | None] = [None] * choices

    def piece(self, index: int, out: OutputMsg) -> tuple[dict[str, Any] | None, Any]:
        """(this output's `logprobs` body, its `prompt_logprobs` body), each None where it has
        none; also kept for `whole`."""
        tokens = out.logprobs or []
        if self.chat:
            if not tokens:
                return None, None
            body = chat_logprobs(tokens)
            self._content[index].extend(body["content"])
            return body, None
        prompt_body = None
        entries = list(tokens)
        if out.prompt_logprobs is not None:
            if self.echo:
                entries = out.prompt_logprobs + entries
            if self.prompt:
                prompt_body = self._prompt[index] = prompt_logprobs_body(out.prompt_logprobs)
        if not entries:
            return None, prompt_body
        self._legacy[index].add(entries)
        body = self._legacy[index].take()
        self._pieces[index].append(body)
        return body, prompt_body

    def whole(self, index: int) -> tuple[dict[str, Any], Any]:
        """(the choice's whole `logprobs` body, its `prompt_logprobs` body or None)."""
        if self.chat:
            return {"content": self._content[index]}, None
        pieces = self._pieces[index]
        whole = {key: [x for piece in pieces for x in piece[key]] for key in LEGACY_KEYS}
        return whole, self._prompt[index]
