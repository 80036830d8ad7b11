"""The benchmark scripts still run against the engine (a smoke run; speed is not checked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_offline_benchmark_quick_run(tmp_path: Path) -> None:
    env = {**os.environ, "MINISGL_LOG_LEVEL": "WARNING"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmark" / "offline.py"),
            "--quick",
            "--skip-hf",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    row = next(line for line in result.stdout.splitlines() if "| minisgl |" in line)
    out_tok_s = float(row.split("|")[3].replace(",", ""))
    assert out_tok_s > 0
    assert not re.search(r"\|\s*\d+\s*\|\s*$", row), f"requests of the wrong length: {row}"
