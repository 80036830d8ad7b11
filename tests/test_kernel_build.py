"""The C CPU kernels build wherever they can: a compile error must fail the suite, not quietly
send every test down the PyTorch fallbacks."""

from __future__ import annotations

import platform
import shutil

import pytest

from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_mod


@pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.machine() not in ("x86_64", "AMD64")
    or shutil.which("gcc") is None
    or not ENV.CPU_KERNELS.value,
    reason="the kernels are only built with gcc on x86-64 Linux",
)
def test_cpu_kernels_build_on_x86_64_linux_with_gcc():
    cpu_mod._build()  # raises with the compiler's message on an error
    assert cpu_mod.cpu_kernels() is not None
