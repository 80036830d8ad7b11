"""One chat request as the protocol modules see it (Anthropic's Messages, OpenAI's Responses):
started by the chat path, its output read as reasoning, text and tool calls, whole or piece by
piece, so each API only shapes what it sends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from minisgl.message import OutputMsg
from minisgl.utils import init_logger

from .frontend import RequestGroup
from .generation import ChoiceOutput
from .reasoning import ReasoningStream, split_reasoning
from .responses import APIError
from .structured import GUIDED_FIELDS
from .tools import ToolCalls

logger = init_logger(__name__)

# Chat request fields the other APIs pass on as they are where a client sends them (through
# extra_body): the sampling and structured-output extensions chat takes (vLLM's, SGLang's).
CHAT_EXTENSIONS = ("top_k", "min_p", "seed", "min_tokens", "priority", "separate_reasoning")
CHAT_EXTENSIONS += ("presence_penalty", "frequency_penalty", "repetition_penalty")
CHAT_EXTENSIONS += (*GUIDED_FIELDS, "structured_outputs")


@dataclass
class ChatJob:
    """What the chat path prepared for a request: its group, tool calls and reasoning split."""

    group: RequestGroup
    model: str
    calls: ToolCalls | None
    thinking: bool | None

    @property
    def prompt_tokens(self) -> int:
        return self.group.prompt_tokens[0]


@dataclass
class ChatPiece:
    """A streamed step of the output: its new reasoning and text; on the last one (`finished`
    set) the tool calls read from the whole output and the engine's last message (its counts)."""

    reasoning: str = ""
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    finished: OutputMsg | None = None


async def chat_pieces(job: ChatJob) -> AsyncIterator[ChatPiece]:
    """The output of a one-choice job as it streams: thinking apart from text (partial tags
    held back), text held back while a tool call may be starting."""
    thoughts = None if job.thinking is None else ReasoningStream(job.thinking)
    async for _, out in job.group.outputs():
        done = out.finish_reason is not None
        reasoning, text = "", out.text or ""
        if thoughts is not None:
            reasoning, text = thoughts.piece(text, done)
        calls: list[dict[str, Any]] = []
        if job.calls is not None:
            text = job.calls.feed(0, text)
            if done:
                content, calls = job.calls.finish(0)
                text += content
        yield ChatPiece(reasoning, text, calls, out if done else None)


@dataclass
class ChatResult:
    """A finished one-choice output: its reasoning (None: no parser or none found), text
    (tool calls taken out) and tool calls (chat's form)."""

    reasoning: str | None
    text: str
    calls: list[dict[str, Any]]
    output: ChoiceOutput


def chat_result(job: ChatJob, output: ChoiceOutput) -> ChatResult:
    """Split a whole output as `chat_pieces` splits it streamed."""
    reasoning, text = None, output.text or ""
    if job.thinking is not None:
        reasoning, content = split_reasoning(text, job.thinking)
        text = content or ""
    calls: list[dict[str, Any]] = []
    if job.calls is not None:
        job.calls.texts[0].append(text)
        parsed, calls = job.calls.parse(0)
        text = parsed or ""
    return ChatResult(reasoning, text, calls, output)


class EventWriter(Protocol):
    """An API's stream of events for one output (its SSE text per step)."""

    def start(self) -> str: ...
    def reasoning(self, text: str) -> str: ...
    def text(self, text: str) -> str: ...
    def finish(self, piece: ChatPiece) -> str: ...
    def error(self, exc: APIError) -> str: ...


async def stream_events(job: ChatJob, writer: EventWriter) -> AsyncIterator[str]:
    """A one-choice job's output as `writer`'s events; an error after the headers went out
    as its error event; the job aborted when the client goes away."""
    try:
        yield writer.start()
        async for piece in chat_pieces(job):
            if piece.reasoning:
                yield writer.reasoning(piece.reasoning)
            if piece.text:
                yield writer.text(piece.text)
            if piece.finished is not None:
                yield writer.finish(piece)
    except Exception as exc:  # headers are sent already: report in the stream
        if not isinstance(exc, APIError):
            logger.exception("streaming a response failed")
            exc = APIError(f"internal error: {exc}", status=500, type="server_error")
        yield writer.error(exc)
    finally:  # (nothing left to abort at a normal end; else the client went away)
        job.group.abort("client disconnected mid-stream")
