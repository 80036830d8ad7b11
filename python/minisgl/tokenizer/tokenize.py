"""Tokenizer loading and prompt encoding, shared by the tokenizer worker, the shell and LLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_path: str | os.PathLike) -> Any:
    """The model folder's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def read_chat_template(model_path: str | os.PathLike) -> str | None:
    """The model folder's default chat template as its files hold it (chat_template.jinja, or
    tokenizer_config.json's `chat_template`, a string or a named list), without loading the
    tokenizer (seconds a server start waited for); None where the files name none."""
    import json

    folder = Path(model_path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            continue
        template = json.loads((folder / name).read_text()).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        if isinstance(template, str):
            return template
    return None


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


# apply_chat_template's own arguments (and the template's `messages`): what
# chat_template_kwargs may not set, as they are the request's other fields or not text options.
CHAT_TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """A completion prompt, with the tokenizer's special tokens (as the offline LLM does)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """A conversation as the model's chat template writes it: ready for the assistant's turn
    (`add_generation_prompt`), or ending inside the last message (`continue_final_message`);
    `chat_template_kwargs` are the template's own variables (e.g. Qwen3's enable_thinking);
    `tools`: the function tools it presents to the model (OpenAI's shape)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions instead")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(CHAT_TEMPLATE_RESERVED.intersection(extra))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        tools=tools,
        **extra,
    )


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The tokens of `render_chat`. The template already holds the special tokens (BOS, role
    markers), so by default none is added twice."""
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        tools,
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
