"""The C CPU kernels build wherever they can: a compile error must fail the suite, not quietly
send every test down the PyTorch fallbacks."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from minisgl.env import ENV
from minisgl.kernel import build
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


def test_cpu_target_names_a_build_target():
    """MINISGL_CPU_TARGET picks the kernels' instruction set: native, or a kernel.build.TARGETS
    name this CPU runs; any other name is refused naming the choices."""
    from minisgl.kernel.build import NATIVE_FLAGS, TARGETS, can_run

    assert cpu_mod.target_flags("native") == NATIVE_FLAGS
    portable = next(t for t in TARGETS if t.name == "x86-64")
    if can_run(portable):
        assert cpu_mod.target_flags("x86-64") == portable.flags
    with pytest.raises(ValueError, match="MINISGL_CPU_TARGET='avx9'.*x86-64-v3"):
        cpu_mod.target_flags("avx9")


def test_the_build_compiles_every_source_and_rebuilds_on_any_change(tmp_path, monkeypatch):
    """Every .c of csrc is compiled into the library and every file (sources and headers) is in
    its cache tag: an edit to any one of them gives another tag, so it is rebuilt."""
    csrc = Path(build.__file__).with_name("csrc")
    assert list(build.SOURCES) == sorted(csrc.glob("*.c"))
    assert list(build.HEADERS) == sorted(csrc.glob("*.h"))
    copies = {}
    for path in build.SOURCES + build.HEADERS:
        copies[path.name] = tmp_path / path.name
        copies[path.name].write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "SOURCES", tuple(copies[p.name] for p in build.SOURCES))
    monkeypatch.setattr(build, "HEADERS", tuple(copies[p.name] for p in build.HEADERS))
    tag = build._library_tag(build.NATIVE_FLAGS)
    for copy in copies.values():
        text = copy.read_bytes()
        copy.write_bytes(text + b"\n")
        assert build._library_tag(build.NATIVE_FLAGS) != tag, copy.name
        copy.write_bytes(text)
    assert build._library_tag(build.NATIVE_FLAGS) == tag
    assert build._library_tag(build.NATIVE_FLAGS, sanitize=True) != tag
