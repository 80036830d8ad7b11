"""The tokenizer and detokenizer worker processes.

tokenizer:   API server --TokenizeMsg/AbortMsg--> [encode] --UserMsg/AbortMsg--> scheduler
             API server --FlushCacheMsg--> scheduler (passed on)
             API server --EncodeMsg/DecodeMsg--> [answer] --> detokenizer --> API server
detokenizer: scheduler --AcceptedMsg/TokenMsg/StatsMsg--> [decode, stop strings] --> API server
             scheduler --FlushCacheReply--> API server (passed on)

A failure while handling one request's message ends that request alone (an ErrorMsg to the API
server; from the detokenizer also an AbortMsg to the scheduler), never the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    DecodedMsg,
    DecodeMsg,
    EncodedMsg,
    EncodeMsg,
    ErrorMsg,
    FlushCacheMsg,
    FlushCacheReply,
    LoraAdapterMsg,
    LoraAdapterReply,
    OutputMsg,
    StatsMsg,
    TokenizeMsg,
    TokenMsg,
    UserMsg,
)
from minisgl.utils import init_logger
from minisgl.utils.faults import inject as inject_fault

from .detokenize import IncrementalDetokenizer
from .logprobs import TokenTexts
from .tokenize import encode_chat, encode_text, load_tokenizer

logger = init_logger(__name__)

try:  # what a chat template raises for a conversation it refuses (roles out of order, ...)
    from jinja2 import TemplateError as _TemplateError

    _PROMPT_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, _TemplateError)
except ImportError:  # without jinja2 there are no chat templates to refuse anything
    _PROMPT_ERRORS = (ValueError, TypeError)


def _chat_ids(
    tokenizer: Any, msg: TokenizeMsg | EncodeMsg, add_special_tokens: bool = False
) -> list[int]:
    """A message's conversation through the chat template, rendered as the message asks."""
    assert msg.messages is not None
    return encode_chat(
        tokenizer,
        msg.messages,
        msg.add_generation_prompt,
        msg.continue_final_message,
        msg.chat_template_kwargs,
        add_special_tokens,
        tools=msg.tools,
    )


def tokenize_request(tokenizer: Any, msg: TokenizeMsg) -> UserMsg:
    """Encode the request's prompt; raises ValueError for prompts that cannot be encoded."""
    if msg.messages is not None:
        inject_fault("tokenize", (m["content"] for m in msg.messages))
        ids = _chat_ids(tokenizer, msg)
    elif msg.text is not None:
        inject_fault("tokenize", (msg.text,))
        ids = encode_text(tokenizer, msg.text)
    elif msg.input_ids is not None:
        ids = list(msg.input_ids)
    else:
        raise ValueError("the request has no prompt")
    return UserMsg(
        msg.rid,
        ids,
        msg.sampling_params,
        msg.skip_special_tokens,
        msg.spaces_between_special_tokens,
        echo=msg.echo,
        lora=msg.lora,
        pooling=msg.pooling,
        score_tokens=msg.score_tokens,
    )


def answer_text_request(tokenizer: Any, msg: EncodeMsg | DecodeMsg) -> EncodedMsg | DecodedMsg:
    """/tokenize's and /detokenize's work; ValueError/TypeError for what cannot be encoded."""
    if isinstance(msg, DecodeMsg):
        # Special tokens kept, as vLLM's /detokenize: the text holds what the ids say.
        return DecodedMsg(msg.rid, tokenizer.decode(msg.tokens, skip_special_tokens=False))
    if msg.messages is not None:
        ids = _chat_ids(tokenizer, msg, msg.add_special_tokens)
    elif msg.text is not None:
        ids = encode_text(tokenizer, msg.text, msg.add_special_tokens)
    else:
        raise ValueError("nothing to tokenize")
    strs = tokenizer.convert_ids_to_tokens(ids) if msg.return_token_strs else None
    return EncodedMsg(msg.rid, ids, strs)


def text_request_error(msg: EncodeMsg | DecodeMsg, exc: Exception) -> ErrorMsg:
    """The error of a /tokenize or /detokenize request, naming its parameter."""
    if isinstance(msg, DecodeMsg):
        param = "tokens"
    else:
        param = "messages" if msg.messages is not None else "prompt"
    if isinstance(exc, (*_PROMPT_ERRORS, OverflowError)):
        return ErrorMsg(msg.rid, f"cannot process the {param}: {exc}", param, "invalid_value")
    logger.error("text request %s failed", msg.rid, exc_info=exc)
    return ErrorMsg(msg.rid, f"processing the request failed: {exc}", None, "request_failed")


def tokenize_error(msg: TokenizeMsg, exc: Exception) -> ErrorMsg:
    """The error for a request whose prompt could not be encoded: the prompt's fault (400)
    when the tokenizer or chat template refused it, else this request's failure (500)."""
    param = "messages" if msg.messages is not None else "prompt"
    if isinstance(exc, _PROMPT_ERRORS):
        return ErrorMsg(msg.rid, f"cannot tokenize the {param}: {exc}", param, "invalid_value")
    logger.error("tokenizing request %s failed", msg.rid, exc_info=exc)
    return ErrorMsg(msg.rid, f"tokenizing the request failed: {exc}", None, "request_failed")


@dataclass
class _DetokState:
    detok: IncrementalDetokenizer
    cached_tokens: int = 0
    pending_tokens: int = 0  # tokens consumed since the last OutputMsg
    text: list[str] = field(default_factory=list)
    logprobs: list[list[Any]] | None = None  # entries since the last OutputMsg, where asked
    prompt_logprobs: list[Any] | None = None  # until the next OutputMsg carries them
    # The EOS / stop token id that ended the request: counted, its text left out unless the
    # request includes stop strings in its output (as vLLM and SGLang).
    stop_token: int | None = None
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None


class DetokenizeManager:
    """Per-request incremental detokenizers: scheduler messages in, API-server messages out.

    A request whose text hits a stop string is finished here (`finish_reason="stop"`), and an
    `AbortMsg` for it is returned for the scheduler, which otherwise would keep generating;
    the scheduler's later outputs for it are dropped.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[int, _DetokState] = {}
        self.token_texts = TokenTexts(tokenizer)

    def handle(self, msgs: list[Any]) -> tuple[list[Any], list[AbortMsg]]:
        """Process a batch of messages; return (messages for the API server, aborts)."""
        to_api: list[Any] = []
        aborts: list[AbortMsg] = []
        touched: dict[int, _DetokState] = {}
        for msg in msgs:
            try:
                self._on_message(msg, to_api, aborts, touched)
            except Exception as exc:
                rid = getattr(msg, "rid", None)
                logger.error("detokenizing request %s failed", rid, exc_info=exc)
                if rid is None:  # nobody's message (stats): nothing to end
                    continue
                touched.pop(rid, None)
                error, abort = self.fail(rid, f"detokenizing the output failed: {exc}")
                to_api.append(error)
                aborts.append(abort)
        # Unfinished requests: one OutputMsg each per batch, however many tokens arrived.
        for rid, state in touched.items():
            if rid in self.states and state.pending_tokens:
                to_api.append(self._output(rid, state, None))
        return to_api, aborts

    def fail(self, rid: int, message: str) -> tuple[ErrorMsg, AbortMsg]:
        """End one request with an error: drop its state; return the ErrorMsg for the API
        server and the AbortMsg for the scheduler (which would keep generating for it)."""
        self.states.pop(rid, None)
        return ErrorMsg(rid, message, None, "request_failed"), AbortMsg(rid)

    def _on_message(
        self,
        msg: Any,
        to_api: list[Any],
        aborts: list[AbortMsg],
        touched: dict[int, _DetokState],
    ) -> None:
        if isinstance(msg, AcceptedMsg):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                msg.stop,
                msg.skip_special_tokens,
                msg.spaces_between_special_tokens,
                msg.include_stop_str,
                msg.min_tokens,
            )
            self.states[msg.rid] = _DetokState(detok)
            if msg.prompt_ids is not None:  # echo: the API server wants the prompt's text
                msg.prompt_text = self.tokenizer.decode(msg.prompt_ids)
                msg.prompt_ids = None
            to_api.append(msg)
        elif isinstance(msg, TokenMsg):
            out = self._on_token(msg, touched, aborts)
            if out is not None:
                to_api.append(out)
        elif isinstance(msg, ErrorMsg):
            self.states.pop(msg.rid, None)
            to_api.append(msg)
        elif isinstance(msg, (StatsMsg, EncodedMsg, DecodedMsg, FlushCacheReply, LoraAdapterReply)):
            to_api.append(msg)  # answers to the API server from the other processes
        else:
            logger.warning("detokenizer: ignoring unexpected %s", type(msg).__name__)

    def _on_token(
        self, msg: TokenMsg, touched: dict[int, _DetokState], aborts: list[AbortMsg]
    ) -> OutputMsg | None:
        state = self.states.get(msg.rid)
        if state is None:  # finished here already (stop string): late tokens are moot
            return None
        if msg.cached_tokens:
            state.cached_tokens = msg.cached_tokens
        if msg.spec_verify_ct is not None:
            state.spec_verify_ct, state.spec_accepted_tokens = (
                msg.spec_verify_ct,
                msg.spec_accepted_tokens,
            )
        if msg.prompt_logprobs is not None:
            state.prompt_logprobs = self.token_texts.entries(msg.prompt_logprobs)
        if msg.embedding is not None:
            state.embedding = msg.embedding
        if msg.token is not None:
            inject_fault("detokenize", state.detok.stop)
            if msg.logprobs is not None:
                logprob, top = msg.logprobs
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.append(self.token_texts.entry(msg.token, logprob, top))
            state.pending_tokens += 1
            if msg.finish_reason == "stop" and not state.detok.include_stop_str:
                state.stop_token = msg.token  # the scheduler stops on EOS / stop ids only
            else:
                state.text.append(state.detok.add_token(msg.token))
        if state.detok.stopped:
            aborts.append(AbortMsg(msg.rid))
            return self._finish(msg.rid, state, "stop")
        if msg.finish_reason is not None:
            if msg.finish_reason != "abort":
                state.text.append(state.detok.finish())
            return self._finish(msg.rid, state, msg.finish_reason)
        touched[msg.rid] = state
        return None

    def _finish(self, rid: int, state: _DetokState, reason: str) -> OutputMsg:
        del self.states[rid]
        return self._output(rid, state, reason)

    def _output(self, rid: int, state: _DetokState, reason: str | None) -> OutputMsg:
        detok = state.detok
        matched: str | int | None = None
        if reason == "stop":
            matched = detok.matched_stop if detok.stopped else state.stop_token
            if matched is None and detok.token_ids:  # included in the text: the last token
                matched = detok.token_ids[-1]
        out = OutputMsg(
            rid,
            "".join(state.text),
            state.pending_tokens,
            reason,
            completion_tokens=len(detok.token_ids) + (state.stop_token is not None),
            cached_tokens=state.cached_tokens,
            logprobs=state.logprobs,
            prompt_logprobs=state.prompt_logprobs,
            matched_stop=matched,
            spec_verify_ct=state.spec_verify_ct,
            spec_accepted_tokens=state.spec_accepted_tokens,
            embedding=state.embedding,
        )
        state.text.clear()
        state.pending_tokens = 0
        state.logprobs = state.prompt_logprobs = None
        return out


def run_tokenizer_worker(model_path: str, addrs: Any, ready: Connection) -> None:
    """Process entry: encode requests and pass them (and aborts) on to the scheduler."""
    from minisgl.message.queue import ZmqPullQueue, ZmqPushQueue
    from minisgl.utils.mp import set_worker_threads, worker_setup

    worker_setup()
    set_worker_threads(1)
    tokenizer = load_tokenizer(model_path)
    inbox = ZmqPullQueue(addrs.tokenizer)
    to_scheduler = ZmqPushQueue(addrs.scheduler)
    to_detokenizer = ZmqPushQueue(addrs.detokenizer)
    ready.send("ready")
    ready.close()
    while True:
        forward: list[Any] = []
        errors: list[Any] = []  # and the answers to text requests, all for the API server
        for msg in inbox.get():
            if isinstance(msg, TokenizeMsg):
                try:
                    forward.append(tokenize_request(tokenizer, msg))
                except Exception as exc:
                    errors.append(tokenize_error(msg, exc))
            elif isinstance(msg, (EncodeMsg, DecodeMsg)):
                try:
                    errors.append(answer_text_request(tokenizer, msg))
                except Exception as exc:
                    errors.append(text_request_error(msg, exc))
            elif isinstance(msg, (AbortMsg, FlushCacheMsg, LoraAdapterMsg)):
                forward.append(msg)
            else:
                logger.warning("tokenizer: ignoring unexpected %s", type(msg).__name__)
        for msg, exc in to_scheduler.put_encodable(forward):
            logger.error("cannot send request %s to the scheduler", msg.rid, exc_info=exc)
            errors.append(ErrorMsg(msg.rid, f"internal error: {exc}", None, "request_failed"))
        to_detokenizer.put_many(errors)


def run_detokenizer_worker(model_path: str, addrs: Any, ready: Connection) -> None:
    """Process entry: turn the scheduler's tokens into text for the API server."""
    from minisgl.message.queue import ZmqPullQueue, ZmqPushQueue
    from minisgl.utils.mp import set_worker_threads, worker_setup

    worker_setup()
    set_worker_threads(1)
    manager = DetokenizeManager(load_tokenizer(model_path))
    inbox = ZmqPullQueue(addrs.detokenizer)
    to_api = ZmqPushQueue(addrs.api_server)
    to_scheduler = ZmqPushQueue(addrs.scheduler)
    ready.send("ready")
    ready.close()
    while True:
        out, aborts = manager.handle(inbox.get())
        to_scheduler.put_many(aborts)  # first: stop computing as early as possible
        for msg, exc in to_api.put_encodable(out):
            logger.error("cannot send %s to the API server", type(msg).__name__, exc_info=exc)
            if hasattr(msg, "rid"):
                error, abort = manager.fail(msg.rid, f"internal error: {exc}")
                to_api.put(error)
                to_scheduler.put(abort)
