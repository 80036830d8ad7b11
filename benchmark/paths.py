"""Where the benchmarks' files are, and minisgl importable from a checkout without
`pip install -e .` (import this module before anything from minisgl)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "benchmark" / "out"
PEERS_DIR = REPO_ROOT / ".peers"
VLLM_RUNNER = REPO_ROOT / "benchmark" / "peers" / "vllm_offline.py"

try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "python"))
