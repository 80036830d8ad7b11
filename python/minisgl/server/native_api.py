"""The native endpoints beside the OpenAI API: SGLang's /generate, /get_model_info and
/get_server_info (also as /model_info and /server_info, its current names), /health_generate,
/flush_cache and /version, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from minisgl import __version__
from minisgl.core import SamplingParams
from minisgl.message import DecodeMsg, EncodeMsg, ErrorMsg, FlushCacheMsg, OutputMsg, TokenizeMsg
from minisgl.utils import init_logger

from .frontend import RequestGroup, api_error
from .generation import ChoiceOutput, collect_outputs, sse, start_group
from .native_protocol import (
    SAMPLING_NAMES,
    DetokenizeRequest,
    NativeGenerateRequest,
    TokenizeRequest,
)
from .responses import APIError
from .sampling import sample_seed
from .state import ServerState
from .validation import check_batch_size, parse_request

logger = init_logger(__name__)

# /health_generate's one-token generation must finish within this (SGLang's default).
HEALTH_GENERATE_TIMEOUT_S = 20.0


def finish_reason_json(out: ChoiceOutput) -> dict[str, Any] | None:
    """SGLang's finish_reason object: what ended the request and the detail that says how."""
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    return {"type": reason, "message": f"the request ended with {reason!r}"}


@dataclasses.dataclass
class _NativeChoice:
    """One sub-request of a /generate call, as its response names it."""

    meta_id: str
    prompt_tokens: int = 0
    output: ChoiceOutput = dataclasses.field(default_factory=ChoiceOutput)
    # SGLang's logprobs: asked for, from which prompt position (-1: none), with token texts.
    return_logprob: bool = False
    logprob_start_len: int = -1
    text_in_logprobs: bool = False
    output_logprobs: list[list[Any]] = dataclasses.field(default_factory=list)
    input_logprobs: list[list[Any]] = dataclasses.field(default_factory=list)

    # Speculative decoding: the verify steps and drafts accepted so far (None: off).
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0

    def add_logprobs(self, out: OutputMsg) -> None:
        """Keep an output's log-probability entries (see OutputMsg.logprobs) and its
        speculative counters."""
        self.output_logprobs.extend(out.logprobs or [])
        if out.spec_verify_ct is not None:
            self.spec_verify_ct, self.spec_accepted_tokens = (
                out.spec_verify_ct,
                out.spec_accepted_tokens,
            )
        if out.prompt_logprobs is not None:
            self.input_logprobs = out.prompt_logprobs[max(self.logprob_start_len, 0) :]

    def _logprob_fields(self) -> dict[str, Any]:
        """meta_info's input/output token logprobs and top logprobs, as SGLang lays them out:
        [logprob, token id, text or None] each (the first prompt token's logprob None)."""

        def triple(token: int, text: str, logprob: float | None) -> list[Any]:
            return [logprob, token, text if self.text_in_logprobs else None]

        def fields(entries: list[list[Any]]) -> tuple[list[Any], list[Any]]:
            tokens = [triple(token, text, lp) for token, text, lp, _ in entries]
            tops = [
                None if lp is None else [triple(t, x, v) for t, x, v in top]
                for _, _, lp, top in entries
            ]
            return tokens, tops

        input_tokens, input_tops = fields(self.input_logprobs)
        output_tokens, output_tops = fields(self.output_logprobs)
        return {
            "input_token_logprobs": input_tokens,
            "output_token_logprobs": output_tokens,
            "input_top_logprobs": input_tops,
            "output_top_logprobs": output_tops,
        }

    def body(self, arrival: float, index: int | None = None) -> dict[str, Any]:
        out = self.output
        meta = {
            "id": self.meta_id,
            "finish_reason": finish_reason_json(out),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "e2e_latency": time.perf_counter() - arrival,
        }
        if self.spec_verify_ct is not None:  # SGLang's names
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accept_length"] = (
                1.0 + self.spec_accepted_tokens / self.spec_verify_ct
                if self.spec_verify_ct
                else 0.0
            )
        if self.return_logprob:
            meta.update(self._logprob_fields())
        body: dict[str, Any] = {"text": out.text, "meta_info": meta}
        if index is not None:
            body["index"] = index
        return body


def _model_config(model_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def register_native_routes(
    app: FastAPI, state: ServerState, check_model: Callable[[str | None], None]
) -> None:
    """Add the native routes to the app (`check_model`: the OpenAI routes' model check)."""

    def check_lora(name: str | None) -> str | None:
        if name is not None and name not in state.lora_adapters:
            known = sorted(state.lora_adapters)
            raise APIError(
                f"no LoRA adapter {name!r} is loaded (loaded: {known})",
                param="lora_path",
                code="invalid_value",
            )
        return name

    frontend = state.frontend
    config = _model_config(state.model_path)

    async def call(msg: Any) -> Any:
        reply = await frontend.call(msg)
        if isinstance(reply, ErrorMsg):
            raise api_error(reply, {})
        return reply

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The server's version."""
        return {"version": __version__}

    @app.get("/model_info")  # SGLang's current name (sglang-router asks it first)
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        """SGLang's model info: path, tokenizer, architectures."""
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "served_model_name": state.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "max_model_len": state.max_model_len,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        """SGLang's server info: the launch arguments and the engine's limits."""
        return {**state.server_info, "max_model_len": state.max_model_len, "version": __version__}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """A one-token generation through every process: 200 once it is done, else 503."""
        if not frontend.healthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        msg = TokenizeMsg(frontend.new_rid(), SamplingParams(max_tokens=1), input_ids=[0])

        async def run(group: RequestGroup) -> None:
            await group.wait_accepted()
            async for _ in group.outputs():
                pass

        try:
            group = RequestGroup(frontend, [msg], {})
        except APIError as exc:
            return JSONResponse({"status": "unhealthy", "error": exc.message}, status_code=503)
        try:
            await asyncio.wait_for(run(group), HEALTH_GENERATE_TIMEOUT_S)
        except (APIError, asyncio.TimeoutError) as exc:
            why = getattr(exc, "message", None) or "no token within the time limit"
            logger.error("health_generate failed: %s", why)
            return JSONResponse({"status": "unhealthy", "error": why}, status_code=503)
        finally:
            group.abort("health check over", client_gone=False)  # no-op once finished
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(tier: int = 0) -> Response:
        """Empty the prefix cache (`?tier=1`: the disk KV tier too); refused (400) while
        requests are queued or running."""
        reply = await call(FlushCacheMsg(frontend.new_rid(), tier=bool(tier)))
        return PlainTextResponse(reply.message + "\n", status_code=200 if reply.flushed else 400)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt or conversation's token ids."""
        req = parse_request(TokenizeRequest, await request.body())
        check_model(req.model)
        reply = await call(EncodeMsg(frontend.new_rid(), **req.encode_fields()))
        return {
            "count": len(reply.tokens),
            "max_model_len": state.max_model_len,
            "tokens": reply.tokens,
            "token_strs": reply.token_strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token ids."""
        req = parse_request(DetokenizeRequest, await request.body())
        check_model(req.model)
        vocab = state.vocab_size
        outside = [t for t in req.tokens if vocab is not None and t >= vocab]
        if outside:
            raise APIError(
                f"tokens must lie in [0, {vocab}), got {outside[:8]}",
                param="tokens",
                code="invalid_value",
            )
        reply = await call(DecodeMsg(frontend.new_rid(), list(req.tokens)))
        return {"prompt": reply.text}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        """SGLang's native generation: text or token ids, one or a batch, n samples each."""
        arrival = time.perf_counter()
        req = parse_request(NativeGenerateRequest, await request.body())
        req.check_unsupported()
        param, prompts = req.prompts()
        limit = state.max_batch_prompts
        check_batch_size(len(prompts), len(prompts), limit, param)  # before parsing the rest
        sampling = req.sampling(len(prompts))
        sequences = sum(options.n for options in sampling)
        check_batch_size(len(prompts), sequences, limit, param, "sampling_params.n")
        logprob_options = req.logprob_options(len(prompts))
        msgs: list[TokenizeMsg] = []
        choices: list[_NativeChoice] = []
        ids = req.request_ids(len(prompts))
        loras = [check_lora(name) for name in req.loras(len(prompts))]
        for prompt, options, meta_id, (ret, start, top), lora in zip(
            prompts, sampling, ids, logprob_options, loras
        ):
            logprobs = (top, top if start >= 0 else None) if ret else (None, None)
            sp = options.to_sampling_params(
                state.max_model_len, state.vocab_size, logprobs, req.priority
            )
            for j in range(options.n):
                sp_j = sp if j == 0 else dataclasses.replace(sp, seed=sample_seed(sp.seed, j))
                text_options = {
                    "skip_special_tokens": options.skip_special_tokens,
                    "spaces_between_special_tokens": options.spaces_between_special_tokens,
                }
                msgs.append(
                    TokenizeMsg(frontend.new_rid(), sp_j, **prompt, **text_options, lora=lora)
                )
                choice = _NativeChoice(meta_id if options.n == 1 else f"{meta_id}-{j}")
                choice.return_logprob, choice.logprob_start_len = ret, start
                choice.text_in_logprobs = req.return_text_in_logprobs
                choices.append(choice)
        group = await start_group(frontend, msgs, {"prompt": param, **SAMPLING_NAMES})
        for choice, prompt_tokens in zip(choices, group.prompt_tokens):
            choice.prompt_tokens = prompt_tokens
        single = req.is_single and len(choices) == 1
        if req.stream:
            events = _stream(group, choices, arrival, single)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await collect_outputs(request, group, lambda i, out: choices[i].add_logprobs(out))
        if outputs is None:
            return Response(status_code=499)  # the client went away
        for choice, out in zip(choices, outputs):
            choice.output = out
        bodies = [choice.body(arrival) for choice in choices]
        return JSONResponse(bodies[0] if single else bodies)


async def _stream(
    group: RequestGroup, choices: list[_NativeChoice], arrival: float, single: bool
) -> AsyncIterator[str]:
    """SGLang's stream: one event per output of a sub-request, carrying its whole text so far
    (and `index` in a batch), then [DONE]."""
    try:
        async for i, out in group.outputs():
            choices[i].add_logprobs(out)
            o = choices[i].output
            o.pieces.append(out.text)
            o.completion_tokens, o.cached_tokens = out.completion_tokens, out.cached_tokens
            o.finish_reason, o.matched_stop = out.finish_reason, out.matched_stop
            if out.text or out.finish_reason is not None:
                yield sse(choices[i].body(arrival, None if single else i))
        yield sse("[DONE]")
    except Exception as exc:  # headers are sent already: report in the stream
        if not isinstance(exc, APIError):
            logger.exception("streaming a /generate response failed")
            exc = APIError(f"internal error: {exc}", status=500, type="server_error")
        yield sse(exc.body())
        yield sse("[DONE]")
    finally:
        group.abort("client disconnected mid-stream")
