"""The request the server benchmarks stream from minisgl's native /generate: greedy, a fixed
number of new tokens, any other body fields (the prompt as `text` or `input_ids`, `priority`)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def greedy_generate_request(port: int, max_tokens: int, **fields: Any) -> urllib.request.Request:
    """A streamed greedy /generate of exactly `max_tokens` new tokens on localhost:`port`."""
    body = {
        **fields,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
