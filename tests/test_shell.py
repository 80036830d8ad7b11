"""`python -m minisgl --shell`, driven through stdin (no terminal: plain line input)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import tiny_model

TURN = re.compile(r"\[(\d+) prompt tokens \((\d+) cached\), (\d+) generated, (\w+), [\d.]+ tok/s\]")


def test_shell_multi_turn_reset_and_exit():
    script = "Hello there\nHow are you?\n/bogus\n\n/reset\nHi\n/exit\nnever read\n"
    cmd = [
        sys.executable,
        "-m",
        "minisgl",
        "--shell",
        "--model",
        str(tiny_model("qwen3")),
        "--dtype",
        "float32",
        "--num-pages",
        "2048",
        "--max-seq-len",
        "512",
        "--shell-max-tokens",
        "8",
    ]
    done = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    turns = [tuple(int(x) if x.isdigit() else x for x in m) for m in TURN.findall(out)]
    assert len(turns) == 3, out  # "never read" comes after /exit
    (p1, c1, g1, _), (p2, c2, g2, _), (p3, c3, _, _) = turns
    assert g1 >= 1 and g2 >= 1
    # Turn 2 re-sends turn 1 (prompt and reply): the radix cache serves at least turn 1's prompt.
    assert p2 > p1 and c2 >= p1 - 1, turns
    # After /reset the conversation starts over: a short prompt again, the shared system
    # prompt still cached.
    assert p3 < p2 and 0 < c3 < p3, turns
    assert "[conversation cleared]" in out
    assert "[unknown command /bogus]" in out
    assert "\033[" not in out  # no terminal: no colour codes
