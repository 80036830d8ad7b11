"""Log-probability entries with each token's text, for the API server: the scheduler sends ids
and values, the detokenizer (which has the tokenizer) adds the text of every token."""

from __future__ import annotations

from typing import Any


class TokenTexts:
    """The text of single tokens as OpenAI's logprobs report them (a byte-level BPE token's
    own characters, e.g. " Paris"), remembered per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([piece]) if piece is not None else ""
            self._texts[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float | None, top: list[list[Any]]) -> list[Any]:
        """[token id, text, logprob, [[id, text, logprob], ...]] (see OutputMsg.logprobs);
        logprob None for a prompt's first token."""
        alternatives = [[alt, self(alt), alt_logprob] for alt, alt_logprob in top]
        return [token_id, self(token_id), logprob, alternatives]

    def entries(self, rows: list[list[Any]]) -> list[list[Any]]:
        """`entry` of each [token id, logprob, alternatives] row."""
        return [self.entry(token, logprob, top) for token, logprob, top in rows]
