"""The OpenAI-compatible HTTP server: CLI args, launcher, FastAPI app, protocol, metrics."""

from .args import ServerArgs, parse_args
from .launch import launch_server, main

__all__ = ["ServerArgs", "launch_server", "main", "parse_args"]
