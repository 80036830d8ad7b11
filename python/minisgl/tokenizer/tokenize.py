"""Tokenizer loading and prompt encoding, shared by the tokenizer worker, the shell and LLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_path: str | os.PathLike) -> Any:
    """The model folder's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def extra_eos_ids(model_path: str | os.PathLike, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids beyond the model config's: the tokenizer's and the generation
    config's (chat models often end a turn with a token the config does not list)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if (Path(model_path) / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt, with the tokenizer's special tokens (as the offline LLM does)."""
    return list(tokenizer(text).input_ids)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Render a conversation with the model's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS, role markers): add none twice.
    return list(tokenizer(text, add_special_tokens=False).input_ids)
