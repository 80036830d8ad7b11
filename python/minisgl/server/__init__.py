"""The OpenAI-compatible HTTP server: CLI args, launcher, FastAPI app, protocol, metrics."""

from __future__ import annotations

from typing import Any

__all__ = ["ServerArgs", "launch_server", "main", "parse_args"]


def __getattr__(name: str) -> Any:
    # On first use, not on import: importing any of this package's modules (the launcher's
    # included) must not pull in torch and FastAPI before `main` starts the fork server.
    if name in ("ServerArgs", "parse_args"):
        from . import args

        return getattr(args, name)
    if name in ("launch_server", "main"):
        from . import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
