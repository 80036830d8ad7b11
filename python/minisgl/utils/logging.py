"""Package logger with one consistent format."""

from __future__ import annotations

import logging
import sys


def init_logger(name: str) -> logging.Logger:
    from minisgl.env import ENV

    logger = logging.getLogger(name)
    root = logging.getLogger("minisgl")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(ENV.LOG_LEVEL.value)
        root.propagate = False
    return logger
