"""Incremental detokenization with stop strings: text deltas that add up to the full decode."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# What a decoder yields for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's growing token list into text deltas, and cuts at stop strings.

    Each `add_tokens` returns only text that is final: never half of a multi-byte character
    (the decode of the newest tokens ending in U+FFFD waits for the next token), and never a
    possible beginning of a stop string (held back until it either completes, and is then cut
    with everything after it, or turns out to be ordinary text). `finish` releases what is
    still held. The deltas concatenate to `tokenizer.decode(token_ids)` cut before the first
    stop string (after it with `include_stop_str`).

    With `min_tokens`, a stop string ends the text only where it ends in the text of that
    token or a later one (vLLM's and SGLang's min_tokens: no stop condition before it).

    Each step decodes a short window: the tokens since the last release (`read_offset`) plus
    the ones before them (from `prefix_offset`) as context, because some tokenizers decode a
    token differently at the start of a text (e.g. dropping a leading space).
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        # Honoured by tokenizers that join added tokens themselves (transformers' Python
        # tokenizers); the Rust-backed ones decode them without spaces whatever it says.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str = include_stop_str  # the text ends with the matched stop string
        self.min_tokens = min_tokens
        # Characters of `text` decoded before token `min_tokens`: a stop string must end past
        # them (known once min_tokens - 1 tokens are in).
        self._stops_from = 0
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (whole characters only), cut at a stop string
        self.released = 0  # characters of `text` handed out
        self.matched_stop: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def stopped(self) -> bool:
        """A stop string matched: the text is final and further tokens are ignored."""
        return self.matched_stop is not None

    @property
    def output_text(self) -> str:
        """The text released so far."""
        return self.text[: self.released]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token: int) -> str:
        """`add_tokens([token])`."""
        return self.add_tokens((token,))

    def add_tokens(self, tokens: Iterable[int]) -> str:
        """Append generated tokens; return the newly final text (often "", never None)."""
        if self.stopped:
            return ""
        delta = ""
        for token in tokens:
            self.token_ids.append(token)
            self._decode_window()
            if len(self.token_ids) == self.min_tokens - 1:
                self._stops_from = len(self.text)
            delta += self._release(final=False)
            if self.stopped:
                break
        return delta

    def finish(self) -> str:
        """The request ended (EOS, length): release all held text, completing it with
        whatever the last tokens decode to even if they end mid-character."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            self.text = full
        else:
            # A tokenizer whose decode is not prefix-stable (e.g. space clean-up rules):
            # released text cannot be taken back, so only append the undecoded tail.
            self.text += self._decode(self.token_ids[self._read_offset :])
        self._read_offset = len(self.token_ids)
        return self._release(final=True)

    def _decode_window(self) -> None:
        ids = self.token_ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        after = self._decode(ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _release(self, final: bool) -> str:
        start = self.released
        # Released text never ends with a possible stop prefix, so a match starts after it.
        hits = []
        if len(self.token_ids) >= self.min_tokens:
            for s in self.stop:
                at = self.text.find(s, max(start, self._stops_from - len(s) + 1))
                if at != -1:
                    hits.append((at, s))
        if hits:
            end, self.matched_stop = min(hits)
            if self.include_stop_str:
                end += len(self.matched_stop)
            self.text = self.text[:end]
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back(start)
        self.released = end
        return self.text[start:end]

    def _held_back(self, start: int) -> int:
        """Length of the longest unreleased suffix that a stop string could begin with."""
        tail = self.text[start:]
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), held, -1):
                if tail.endswith(s[:k]):
                    held = k
                    break
        return held
