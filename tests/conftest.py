"""Suite-wide settings (applied before any test imports minisgl) and shared fixtures."""

import os

import openai
import pytest

# The engine's thread count follows other processes' load (engine/cpu_threads.py). The suite
# runs servers, HF and engines side by side, so it keeps the count fixed for results that repeat
# bit for bit; tests/test_cpu_threads.py turns it on where it is the subject.
os.environ.setdefault("MINISGL_ADAPTIVE_THREADS", "0")


@pytest.fixture(scope="module")
def client(server):
    """The official client on the module's `server` (a test module that starts one)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    """The name the server serves its model under."""
    return client.models.list().data[0].id


def pytest_terminal_summary(terminalreporter) -> None:
    """The quantized kernels' paths each kernel form ran (tests/test_kernel_fuzz.py fails when
    one its build can take did not run)."""
    import sys

    fuzz = sys.modules.get("test_kernel_fuzz")
    ran = getattr(fuzz, "PATHS_RAN", None)
    if not ran:
        return
    terminalreporter.section("quantized kernel paths run, per kernel form")
    for form, paths in ran.items():
        terminalreporter.write_line(f"{form}: {', '.join(paths)}")
