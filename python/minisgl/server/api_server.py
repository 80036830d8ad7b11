"""The FastAPI app: the OpenAI-compatible endpoints over the frontend manager (the native ones
are registered from native_api.py), API-key checking and error bodies."""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl import __version__
from minisgl.core import SamplingParams
from minisgl.message import EncodeMsg, ErrorMsg, LoraAdapterMsg, TokenizeMsg
from minisgl.utils import init_logger

from .anthropic import anthropic_error, register_anthropic_routes
from .chat_job import ChatJob
from .embeddings import register_embedding_routes
from .frontend import api_error
from .generation import start_group
from .logprobs import ChoiceLogprobs
from .native_api import register_native_routes
from .openai_chat import serve
from .openai_responses import register_responses_routes
from .protocol import ChatCompletionRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest
from .reasoning import REASONING_PARSERS
from .rerank import register_rerank_routes
from .responses import APIError, ResponseFormatter, new_id, now
from .state import OPEN_PATHS, ServerState
from .tools import ToolCalls, template_tools
from .validation import check_batch_size, parse_request

logger = init_logger(__name__)


@dataclasses.dataclass
class ChatParts:
    """A checked chat request's prompt (TokenizeMsg fields), sampling parameters, the names its
    parameters go by in errors, its tool calls' reader and its reasoning split (None: none)."""

    prompt: dict[str, Any]
    sampling: SamplingParams
    names: dict[str, str]
    calls: ToolCalls | None
    thinking: bool | None
    lora: str | None = None  # the LoRA adapter its `model` names


class _APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` everywhere but OPEN_PATHS (health, metrics).

    Plain ASGI rather than FastAPI's `@app.middleware`, which wraps every response and
    interferes with streaming and disconnect detection.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()  # Anthropic's x-api-key header

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if not (
                hmac.compare_digest(given, self.expected)
                or hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
            ):
                error = APIError(
                    "invalid or missing API key (send 'Authorization: Bearer <key>' or "
                    "'x-api-key: <key>')",
                    status=401,
                    code="invalid_api_key",
                )
                anthropic = scope["path"].startswith("/v1/messages")
                response = anthropic_error(error) if anthropic else error.response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    """Build the app; `state.frontend` is started and stopped with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.frontend.start()
        try:
            yield
        finally:
            await state.frontend.stop()

    app = FastAPI(title="minisgl", version=__version__, lifespan=lifespan)
    app.state.minisgl = state

    def error_response(request: Request, exc: APIError) -> JSONResponse:
        """OpenAI's error body, or Anthropic's on its Messages routes."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error(exc)
        return exc.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status != 401:
            state.metrics.errors.labels(str(exc.status)).inc()
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(request, APIError(str(exc.detail), exc.status_code, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, APIError(str(exc), code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug: Starlette logs its traceback after this; the client gets an OpenAI body (an
        # Anthropic one on the Messages routes, as for every other error there).
        state.metrics.errors.labels("500").inc()
        error = APIError(f"internal error: {exc}", status=500, type="server_error")
        return error_response(request, error)

    if state.api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=state.api_key)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the server's processes run, else 503."""
        if not state.frontend.healthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (requests, tokens, latencies, cache, speculation)."""
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "minisgl",
            "root": state.model_path,
            "max_model_len": state.max_model_len,
        }

    def adapter_card(name: str) -> dict[str, Any]:
        """A LoRA adapter as vLLM lists one: its folder as root, the base model as parent."""
        path = state.lora_adapters[name]
        return {**model_card(), "id": name, "root": path, "parent": state.model_name}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """OpenAI's model list: the served model and its LoRA adapters (`parent`: the model)."""
        adapters = [adapter_card(name) for name in state.lora_adapters]
        return {"object": "list", "data": [model_card(), *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        """One model or LoRA adapter by its name (404 if not served)."""
        lora = check_model(model_id)
        return model_card() if lora is None else adapter_card(lora)

    def check_model(model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 if none."""
        if model is None or model in (state.model_name, state.model_path):
            return None
        if model in state.lora_adapters:
            return model
        served = [state.model_name, *state.lora_adapters]
        raise APIError(
            f"the model '{model}' does not exist; this server serves {served}",
            status=404,
            param="model",
            code="model_not_found",
        )

    async def lora_adapter(msg: LoraAdapterMsg, param: str) -> Response:
        reply = await state.frontend.call(msg)
        if isinstance(reply, ErrorMsg):
            raise api_error(reply, {})
        if not reply.done:
            raise APIError(reply.message, param=param, code="invalid_value")
        if msg.path is None:
            state.lora_adapters.pop(msg.name, None)
        else:
            state.lora_adapters[msg.name] = msg.path
        return PlainTextResponse(f"Success: {reply.message}")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: register {lora_name, lora_path} (a PEFT folder) while serving."""
        body = parse_request(LoadLoraRequest, await request.body())
        if body.lora_name in (state.model_name, *state.lora_adapters):
            raise APIError(
                f"the name {body.lora_name!r} is taken", param="lora_name", code="invalid_value"
            )
        msg = LoraAdapterMsg(state.frontend.new_rid(), body.lora_name, body.lora_path)
        return await lora_adapter(msg, "lora_path")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: stop serving {lora_name}; its running requests finish first."""
        body = parse_request(UnloadLoraRequest, await request.body())
        if body.lora_name not in state.lora_adapters:
            raise APIError(
                f"no LoRA adapter {body.lora_name!r} is loaded",
                status=404,
                param="lora_name",
                code="not_found",
            )
        msg = LoraAdapterMsg(state.frontend.new_rid(), body.lora_name, None)
        return await lora_adapter(msg, "lora_name")

    def chat_parts(req: ChatCompletionRequest) -> ChatParts:
        """A chat request checked and turned into its prompt, sampling parameters, the names
        its parameters go by, its tool calls' reader and its reasoning split."""
        lora = check_model(req.model)
        req.check_unsupported()
        check_batch_size(1, req.n, state.max_batch_prompts, "messages")
        messages = req.chat_messages()
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        # None (no limit given): what the context leaves after the prompt.
        sp = req.sampling_params(max_tokens, param, state.max_model_len, state.vocab_size)
        tools = req.tool_choice_spec()
        prompt = {"messages": messages, **req.template_fields(), "tools": template_tools(tools)}
        calls = ToolCalls(tools, state.tool_parser) if tools.active else None
        parser = state.reasoning_parser if req.separate_reasoning else None
        thinking = None if parser is None else REASONING_PARSERS[parser]
        names = {"prompt": "messages", "max_tokens": param}
        return ChatParts(prompt, sp, names, calls, thinking, lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions: messages through the chat template, whole or streamed."""
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        parts = chat_parts(req)
        endpoint = ResponseFormatter(True, new_id("chatcmpl"), state.model_name, now(), req.n)
        logprobs = ChoiceLogprobs(True, req.n, False, False) if req.logprobs else None
        return await serve(
            state,
            request,
            req,
            endpoint,
            [{**parts.prompt, "lora": parts.lora}],
            parts.sampling,
            parts.names,
            logprobs,
            None,
            parts.calls,
            parts.thinking,
        )

    async def start_chat_job(request: Request, body: dict[str, Any]) -> ChatJob:
        """The chat body a Messages or Responses request means, started (anthropic.py,
        openai_responses.py)."""
        req = parse_request(ChatCompletionRequest, json.dumps(body).encode())
        parts = chat_parts(req)
        msg = TokenizeMsg(state.frontend.new_rid(), parts.sampling, **parts.prompt, lora=parts.lora)
        group = await start_group(state.frontend, [msg], parts.names)
        return ChatJob(group, state.model_name, parts.calls, parts.thinking)

    async def count_message_tokens(body: dict[str, Any]) -> int:
        req = parse_request(ChatCompletionRequest, json.dumps(body).encode())
        prompt = chat_parts(req).prompt
        reply = await state.frontend.call(EncodeMsg(state.frontend.new_rid(), **prompt))
        if isinstance(reply, ErrorMsg):
            raise api_error(reply, {"prompt": "messages"})
        return len(reply.tokens)

    register_anthropic_routes(app, start_chat_job, count_message_tokens)
    register_responses_routes(app, start_chat_job, state.responses)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's completions: text or token-id prompts, whole or streamed."""
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        lora = check_model(req.model)
        req.check_unsupported()
        texts = req.prompts()
        check_batch_size(len(texts), len(texts) * req.n, state.max_batch_prompts, "prompt")
        # A token-id prompt's text comes back from the detokenizer when echoed.
        prompts = [
            {"text": p, "lora": lora}
            if isinstance(p, str)
            else {"input_ids": p, "echo": req.echo, "lora": lora}
            for p in texts
        ]
        # OpenAI's legacy default for completions is 16 tokens.
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        sp = req.sampling_params(max_tokens, "max_tokens", state.max_model_len, state.vocab_size)
        endpoint = ResponseFormatter(False, new_id("cmpl"), state.model_name, now(), req.n)
        logprobs = None
        if sp.logprobs is not None or sp.prompt_logprobs is not None:
            explicit_prompt = req.prompt_logprobs is not None
            logprobs = ChoiceLogprobs(False, len(texts) * req.n, explicit_prompt, req.echo)
        echo = [p if isinstance(p, str) else None for p in texts] if req.echo else None
        return await serve(state, request, req, endpoint, prompts, sp, {}, logprobs, echo)

    register_native_routes(app, state, check_model)
    register_embedding_routes(app, state, check_model, state.pooling)
    register_rerank_routes(app, state, check_model)
    return app
