"""Sending the docs' requests (curl commands, JSON bodies, openai blocks) to a test server,
rewritten to a model it serves and few tokens, and checking each answer's shape."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import re
import time
from urllib.parse import urlsplit

import httpx
from doc_blocks import Block
from test_server import API_KEY

# Generation is capped at MAX_TOKENS (an example without a limit gets one), to keep time.
MAX_TOKENS = 8
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
LIMIT_FOR = {  # a generating endpoint or openai method -> its limit's name
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "chat.completions.create": "max_tokens",
    "completions.create": "max_tokens",
    "responses.create": "max_output_tokens",
}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
LOCAL_URL = re.compile(rf"^(https?://)?({'|'.join(map(re.escape, LOCAL_HOSTS))})(:\d+)?")

# The key an endpoint's JSON answer has; a stream's events: the key one of them has.
SHAPES = {
    "/v1/chat/completions": "choices",
    "/v1/completions": "choices",
    "/v1/responses": "output",
    "/v1/messages": "content",
    "/v1/messages/count_tokens": "input_tokens",
    "/v1/models": "data",
    "/v1/embeddings": "data",
    "/v1/rerank": "results",
    "/rerank": "results",
    "/v2/rerank": "results",
    "/v1/score": "data",
    "/score": "data",
    "/generate": "text",
    "/tokenize": "tokens",
    "/detokenize": "prompt",
    "/get_model_info": "model_path",
    "/model_info": "model_path",
    "/version": "version",
    "/health": "status",
}
# Endpoints that refuse (400) while requests run: another module's last stream may still be
# finishing on the shared server, so they are tried again for a while.
REFUSED_WHILE_BUSY = ("/flush_cache",)
# Endpoints that answer plain text: what the text starts with.
TEXT_ANSWERS = {"/flush_cache": "cache flushed"}
STREAM_SHAPES = {
    "/v1/chat/completions": "choices",
    "/v1/completions": "choices",
    "/v1/responses": "response",
    "/v1/messages": "message",
    "/generate": "text",
}


def served(url: str) -> list[str]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return [m["id"] for m in httpx.get(f"{url}/v1/models", headers=headers).json()["data"]]


# ---------------------------------------------------------------- curl commands and JSON bodies
def rewrite_body(body: object, names: list[str], route: str) -> object:
    """The docs' request as the test server takes it: a model it serves, few tokens."""
    if isinstance(body, list):
        return [rewrite_body(item, names, route) for item in body]
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str) and body["model"] not in names:
        body["model"] = names[0]
    limits = {key: body[key] for key in TOKEN_LIMITS if key in body}
    if route in LIMIT_FOR and not limits:
        body[LIMIT_FOR[route]] = MAX_TOKENS
    if route == "/generate":
        params = dict(body.get("sampling_params") or {})
        params["max_new_tokens"] = min(params.get("max_new_tokens", MAX_TOKENS), MAX_TOKENS)
        body["sampling_params"] = params
    for key, value in limits.items():
        if isinstance(value, int) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    return body


@dataclasses.dataclass
class CurlRequest:
    method: str
    url: str
    headers: dict[str, str]
    data: str | None


CURL_FLAGS = set("sSNfLiv")
CURL_LONG_FLAGS = {"--silent", "--show-error", "--no-buffer", "--fail", "--location", "--include"}


def parse_curl(words: list[str]) -> CurlRequest:
    method, url, headers, data = None, None, {}, None
    rest = iter(words[1:])
    for word in rest:
        if word in ("-X", "--request"):
            method = next(rest)
        elif word in ("-H", "--header"):
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word in ("-d", "--data", "--data-raw", "--data-binary", "--json"):
            data = next(rest)
            assert not data.startswith("@"), f"curl {word} @file is not supported here"
            if word == "--json":
                headers.setdefault("Content-Type", "application/json")
        elif word in CURL_LONG_FLAGS or re.fullmatch(rf"-[{''.join(CURL_FLAGS)}]+", word):
            continue
        elif word.startswith("-"):
            raise AssertionError(f"curl option {word} is not handled by this test: add it")
        else:
            assert url is None, f"two URLs: {url} and {word}"
            url = word
    assert url is not None, "curl without a URL"
    return CurlRequest(method or ("POST" if data is not None else "GET"), url, headers, data)


def local_path(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    assert parts.hostname in LOCAL_HOSTS, f"{url}: not the local server"
    return parts.path + (f"?{parts.query}" if parts.query else "")


def check_answer(path: str, response: httpx.Response, stream: bool) -> None:
    """2xx, and the endpoint's normal answer: JSON with its key (each item of a batch), or a
    stream of JSON events one of which has its key."""
    route = path.partition("?")[0]
    assert 200 <= response.status_code < 300, f"{response.status_code}: {response.text[:500]}"
    if route in TEXT_ANSWERS:
        assert response.text.startswith(TEXT_ANSWERS[route]), f"{route}: {response.text[:500]}"
        return
    assert route in SHAPES, f"no known answer shape for {route}: add it to SHAPES"
    if not stream:
        body, key = response.json(), SHAPES[route]
        items = body if isinstance(body, list) else [body]
        assert all(key in item for item in items), f"{route}: no {key!r} in {str(body)[:500]}"
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    events = [json.loads(item) for item in data if item != "[DONE]"]
    assert events, f"{route}: an empty stream"
    key = STREAM_SHAPES.get(route)
    assert key is None or any(key in event for event in events), f"{route}: no event has {key}"


def ignored_fields(endpoint: str, body: object) -> list[str]:
    """The body's fields the server reads nowhere (it names them in a WARNING and goes on);
    a field parsed on its own ("/generate's sampling_params") too."""
    from minisgl.server.reference import request_models

    if not isinstance(body, dict):
        return []
    route, out = endpoint.partition(" ")[2], []
    for title, model in request_models():
        if title == endpoint:
            value, prefix = body, ""
        elif title.startswith(f"{route}'s "):
            field = title.removeprefix(f"{route}'s ")
            value, prefix = body.get(field), f"{field}."
        else:
            continue
        if isinstance(value, dict):
            with contextlib.suppress(ValueError):  # a refused value: the answer says why
                out += model.model_validate(value).ignored_fields(prefix)
    return out


def send(server_url: str, method: str, path: str, headers: dict, content: str | None) -> None:
    """The docs' request, as the test server takes it, gets its endpoint's normal answer."""
    headers = httpx.Headers(headers)
    headers["Authorization"] = f"Bearer {API_KEY}"
    stream, ignored = False, []
    if content is not None:
        headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # curl's -d
        with contextlib.suppress(ValueError):
            route = path.partition("?")[0]
            body = rewrite_body(json.loads(content), served(server_url), route)
            stream = isinstance(body, dict) and body.get("stream") is True
            content = json.dumps(body)
            ignored = ignored_fields(f"{method} {route}", body)
    for _ in range(40):
        response = httpx.request(
            method, server_url + path, headers=headers, content=content, timeout=120
        )
        if not (path.startswith(REFUSED_WHILE_BUSY) and response.status_code == 400):
            break
        time.sleep(0.25)
    check_answer(path, response, stream)
    assert not ignored, f"{path}: the server ignores {ignored} (a WARNING in its log)"


# ---------------------------------------------------------------- openai blocks
class ToTestServer(ast.NodeTransformer):
    """An openai example aimed at the test server: its URL, key, a model it serves, few
    tokens."""

    def __init__(self, url: str, names: list[str]) -> None:
        self.url, self.names = url, names

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and LOCAL_URL.match(node.value):
            return ast.Constant(LOCAL_URL.sub(self.url, node.value))
        return node

    def visit_keyword(self, node: ast.keyword) -> ast.AST:
        value = node.value
        if node.arg == "api_key":
            node.value = ast.Constant(API_KEY)
        elif node.arg == "model" and isinstance(value, ast.Constant):
            if value.value not in self.names:
                node.value = ast.Constant(self.names[0])
        elif node.arg in TOKEN_LIMITS and isinstance(value, ast.Constant):
            if isinstance(value.value, int) and value.value > MAX_TOKENS:
                node.value = ast.Constant(MAX_TOKENS)
        else:
            self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        method = ast.unparse(node.func)
        limit = next((v for k, v in LIMIT_FOR.items() if method.endswith(f".{k}")), None)
        if limit and not any(k.arg in TOKEN_LIMITS for k in node.keywords):
            node.keywords.append(ast.keyword(limit, ast.Constant(MAX_TOKENS)))
        return node


def imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def uses_openai(tree: ast.AST) -> bool:
    return any(name.split(".")[0] == "openai" for name in imports(tree))


def run_openai_block(block: Block, tree: ast.Module, url: str, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
    tree = ast.fix_missing_locations(ToTestServer(url, served(url)).visit(tree))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, block.where, "exec"), {"__name__": "__main__"})
    assert out.getvalue().strip(), f"{block.where} printed nothing"
