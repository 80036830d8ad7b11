"""The kernel tests again, in a process whose kernels are built under ASan and UBSan
(MINISGL_CPU_SANITIZE=1, libasan preloaded): every form this machine executes, the emulated
AVX-512/VNNI/AMX ones included (a CPU without AVX-512: its native build's code once, as
x86-64-v3's; test_kernel_variants.py), fuzzed over shapes (test_kernel_fuzz.py), through their error
paths (test_kernel_errors.py), their products, elementwise and sampling kernels
(test_kernel_variants.py) and their attention kernels (test_kernel_attention.py). A read or
write outside a buffer, or an undefined operation, aborts that process with a report, which
fails this test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_kernel_variants import ONLY_WHERE_BUILT

from minisgl.kernel.build import sanitizer_preload

pytestmark = ONLY_WHERE_BUILT

TESTS = Path(__file__).parent
SANITIZED_FILES = ["test_kernel_fuzz.py", "test_kernel_variants.py", "test_kernel_errors.py"]
SANITIZED_FILES += ["test_kernel_attention.py"]


def test_the_kernel_tests_pass_under_the_sanitizers():
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=sanitizer_preload(),
        MINISGL_CPU_SANITIZE="1",
        # Python and torch keep their allocations at exit (not the kernels' leaks: they free
        # every buffer on every path, which test_kernel_errors.py's allocation failures walk).
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        OMP_NUM_THREADS="2",
    )
    files = [str(TESTS / name) for name in SANITIZED_FILES]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, (
        f"the sanitized kernel tests failed (rc {done.returncode}):\n{tail}"
    )
    assert " passed" in done.stdout and "failed" not in done.stdout, tail
