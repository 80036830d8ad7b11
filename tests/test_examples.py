"""examples/ch09_radix.py prints the seed chapter's output for the tree part."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED_TREE_OUTPUT = """\
插入 [1,2,3,4]、[1,2,5,6]、[7,8] 之后：
└─ key=[1, 2] value=[10, 11] ref=0
    └─ key=[3, 4] value=[12, 13] ref=0
    └─ key=[5, 6] value=[20, 21] ref=0
└─ key=[7, 8] value=[30, 31] ref=0
匹配 [1,2,3,9]：命中 3 个，位置 [10, 11, 12]；加锁后：
└─ key=[1, 2] value=[10, 11] ref=1
    └─ key=[3] value=[12] ref=1
        └─ key=[4] value=[13] ref=0
    └─ key=[5, 6] value=[20, 21] ref=0
└─ key=[7, 8] value=[30, 31] ref=0
可淘汰 / 受保护: (5, 3)
淘汰 2 个 token，释放位置: [13, 20, 21]
再淘汰 1 个 token，释放位置: [30, 31]
剩下的树：
└─ key=[1, 2] value=[10, 11] ref=1
    └─ key=[3] value=[12] ref=1
"""


def test_ch09_example_output() -> None:
    env = {**os.environ, "MINISGL_NUM_THREADS": "2", "MINISGL_LOG_LEVEL": "WARNING"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ch09_radix.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    out = result.stdout
    assert out.startswith(SEED_TREE_OUTPUT)
    counts = dict(
        (kind, (int(total), int(computed)))
        for kind, total, computed in re.findall(
            r"(naive|radix)\s*: 提示词共 (\d+) 个 token，prefill 实际计算 (\d+) 个", out
        )
    )
    naive_total, naive_computed = counts["naive"]
    radix_total, radix_computed = counts["radix"]
    assert naive_computed == naive_total == radix_total
    # Radix computes the first prompt in full and, for the other three, only their questions
    # (the shared system prompt once).
    system_len = radix_total - radix_computed
    assert radix_computed < naive_computed / 2 and system_len > 0
