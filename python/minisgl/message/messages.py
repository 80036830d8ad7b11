"""The messages that travel between the server's processes.

API server -> tokenizer -> scheduler -> detokenizer -> API server. Every socket carries one
encoded object per frame: a message, or a `BatchMsg` of several (fewer syscalls under load).
Request ids (`rid`) are assigned by the API server; the scheduler keeps its own uids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams

from .codec import register_message


@register_message
@dataclass
class BatchMsg:
    """Several messages sent as one frame."""

    items: list[Any]


@register_message
@dataclass
class TokenizeMsg:
    """API server -> tokenizer: one generation request (exactly one prompt form is set)."""

    rid: int
    sampling_params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    # Chat messages ({"role", "content"} with string content, an assistant's tool_calls, a
    # tool result's tool_call_id), rendered by the chat template.
    messages: list[dict[str, Any]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # How the chat template renders `messages` (see tokenizer.encode_chat).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the API server wants the prompt's text back (AcceptedMsg.prompt_text)
    # Function tools the chat template renders (OpenAI's `tools`), where the request has any.
    tools: list[dict[str, Any]] | None = None
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)
    pooling: str | None = None  # an embedding request: how its hidden states are pooled
    score_tokens: list[int] | None = None  # pooling "score": the tokens whose logits it wants


@register_message
@dataclass
class AbortMsg:
    """Stop a request: API server -> tokenizer -> scheduler (client gone) or detokenizer ->
    scheduler (a stop string matched, so the remaining tokens are not needed)."""

    rid: int


@register_message
@dataclass
class UserMsg:
    """Tokenizer -> scheduler: a tokenized request."""

    rid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    echo: bool = False
    lora: str | None = None
    pooling: str | None = None
    score_tokens: list[int] | None = None


@register_message
@dataclass
class AcceptedMsg:
    """Scheduler -> detokenizer (-> API server): the request is queued.

    Sent on the same socket as the request's tokens and before them, so the detokenizer
    always knows a request's stop strings when its first token arrives.
    """

    rid: int
    prompt_tokens: int
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str: bool = False  # SamplingParams.include_stop_str_in_output
    min_tokens: int = 0  # SamplingParams.min_tokens: no stop string ends the text before it
    # With echo: the prompt's ids from the scheduler, its text from the detokenizer on.
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None


@register_message
@dataclass
class TokenMsg:
    """Scheduler -> detokenizer: one generated token (None only when the request aborted)."""

    rid: int
    token: int | None
    finish_reason: str | None = None
    # Prompt tokens served from the prefix cache; set on the request's first token.
    cached_tokens: int = 0
    # Where asked: [logprob, [[alternative id, logprob], ...]] of this token; on the first
    # token, [token id, logprob, alternatives] per prompt token (the first: logprob None).
    logprobs: list[Any] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    # Speculative decoding: the request's verify steps and accepted drafts so far (None: off).
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled vector


@register_message
@dataclass
class OutputMsg:
    """Detokenizer -> API server: new text of one request (possibly empty while a partial
    character or a possible stop-string prefix is held back)."""

    rid: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    # What ended a "stop": the stop string, or the token id (EOS, stop_token_ids).
    matched_stop: str | int | None = None
    # Where asked, per token of this output [token id, text, logprob, [[id, text, logprob],
    # ...] of the alternatives], and once, the same per prompt token (the first: logprob None).
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    # As TokenMsg's, as of this output.
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled vector


@register_message
@dataclass
class ErrorMsg:
    """Tokenizer or scheduler -> (detokenizer ->) API server: the request was rejected."""

    rid: int
    message: str
    param: str | None = None
    code: str | None = None


@register_message
@dataclass
class StatsMsg:
    """Scheduler -> API server (via the detokenizer): load and KV-cache state for /metrics."""

    running: int
    waiting: int
    num_pages: int
    free_pages: int
    cached_pages: int
    # Cumulative prefix-cache accounting (prompt tokens admitted / served from cache).
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    idle: bool
    # When idle: did free + cached pages account for every page? (None while busy.)
    pages_ok: bool | None = None
    # Lifetime tokens evicted from the radix tree, and the eviction policy that chose them.
    evicted_tokens: int = 0
    eviction_policy: str = ""
    # The disk KV tier's counters (kvcache.TierStats as a dict); None without a tier.
    tier: dict[str, int] | None = None
    # Speculative decoding's lifetime counters (verify_steps, draft_tokens, accepted_tokens);
    # None while it is off.
    spec: dict[str, int] | None = None


@register_message
@dataclass
class EncodeMsg:
    """API server -> tokenizer: tokenize a text or a conversation, no generation (/tokenize).
    The answer comes back through the detokenizer: an EncodedMsg, or an ErrorMsg."""

    rid: int
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


@register_message
@dataclass
class EncodedMsg:
    """Tokenizer -> detokenizer -> API server: the tokens of an EncodeMsg."""

    rid: int
    tokens: list[int]
    token_strs: list[str] | None = None


@register_message
@dataclass
class DecodeMsg:
    """API server -> tokenizer: the text of token ids (/detokenize); answered by a
    DecodedMsg or an ErrorMsg through the detokenizer."""

    rid: int
    tokens: list[int]


@register_message
@dataclass
class DecodedMsg:
    """Tokenizer -> detokenizer -> API server: the text of a DecodeMsg's tokens."""

    rid: int
    text: str


@register_message
@dataclass
class FlushCacheMsg:
    """API server -> tokenizer -> scheduler: empty the prefix cache if no request is running
    (with `tier`, the disk KV tier too)."""

    rid: int
    tier: bool = False


@register_message
@dataclass
class LoraAdapterMsg:
    """API server -> tokenizer -> scheduler: register the LoRA adapter folder `path` as `name`
    (None: unload `name` once its requests are done)."""

    rid: int
    name: str
    path: str | None = None


@register_message
@dataclass
class LoraAdapterReply:
    """Scheduler -> detokenizer -> API server: whether a LoraAdapterMsg was done, and why not."""

    rid: int
    done: bool
    message: str


@register_message
@dataclass
class FlushCacheReply:
    """Scheduler -> detokenizer -> API server: whether the cache was flushed, and why not."""

    rid: int
    flushed: bool
    message: str
