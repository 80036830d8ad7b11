"""Suite-wide settings (applied before any test imports minisgl) and shared fixtures."""

import copy
import functools
import os
import signal
from pathlib import Path

import openai
import pytest

# The engine's thread count follows other processes' load (engine/cpu_threads.py). The suite
# runs servers, HF and engines side by side, so it keeps the count fixed for results that repeat
# bit for bit; tests/test_cpu_threads.py turns it on where it is the subject.
os.environ.setdefault("MINISGL_ADAPTIVE_THREADS", "0")


def _load_tokenizers_once() -> None:
    """A model folder's tokenizer is read once in this process: each of the suite's ~150 engines
    read its own (0.25 s for the tiny Qwen3's 11 MB tokenizer.json). A caller gets a shallow
    copy, so an attribute it sets (a test's chat_template) stays its own; the folder's files'
    sizes and times are the key, so a rewritten folder is read again."""
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained

    @functools.lru_cache(maxsize=16)
    def cached(folder: str, files: tuple) -> object:
        return load(folder)

    def from_pretrained(source, *args, **kwargs):
        folder = Path(str(source))
        if args or kwargs or not folder.is_dir():
            return load(source, *args, **kwargs)
        files = tuple(
            sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir())
        )
        return copy.copy(cached(str(folder.resolve()), files))

    AutoTokenizer.from_pretrained = from_pretrained


_load_tokenizers_once()


@pytest.fixture(scope="module")
def client(server):
    """The official client on the module's `server` (a test module that starts one)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    """The name the server serves its model under."""
    return client.models.list().data[0].id


# ---------------------------------------------------------------- servers shared by modules
# A server start costs 10-15 s on two cores (four processes importing torch): modules whose
# tests need the same server, and only what any server of those settings gives them, share one
# for the whole session. A test that stops one is marked `stops_shared_server` and runs at the
# end of the session (pytest_collection_modifyitems), after every other test that may use it.
def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "stops_shared_server: stops a session-wide server; runs after every other test"
    )


def pytest_collection_modifyitems(config, items) -> None:
    last = [item for item in items if item.get_closest_marker("stops_shared_server")]
    if last:
        items[:] = [item for item in items if item not in last] + last


def _shared(make):
    """A session server, spawned by `make()` and not waited on: each user waits for it to be
    healthy (test_server.py computes its oracle meanwhile); stopped at the end of the session
    unless a test stopped it."""
    server = make()
    try:
        yield server
    finally:
        # Killed outright, the launcher leaves its workers to notice (utils/mp.watch_parent):
        # none may outlive it.
        import psutil

        try:
            workers = psutil.Process(server.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        server.stop(signal.SIGKILL if server.proc.poll() is None else signal.SIGTERM)
        _, alive = psutil.wait_procs(workers, timeout=15)
        for process in alive:
            process.kill()
        assert not alive, f"workers outlived their killed launcher: {[p.pid for p in alive]}"


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """The default model in float32 with test_server.py's settings and API key (test_server.py,
    test_server_native.py)."""
    from helpers import smollm2
    from test_server import API_KEY, SERVER_ARGS, spawn_server

    log = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    yield from _shared(lambda: spawn_server(smollm2(), [*SERVER_ARGS, "--api-key", API_KEY], log))


@pytest.fixture(scope="session")
def tiny_qwen3_server(tmp_path_factory):
    """The tiny float32 Qwen3 (prefill in chunks of 16; test_logprobs.py, test_structured.py),
    LoRA on with one slot (test_lora.py loads its adapters at run time and unloads them)."""
    from helpers import tiny_model
    from test_server import spawn_server

    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    args = ["--dtype", "float32", "--num-pages", "2048", "--max-seq-len", "256"]
    args += ["--max-prefill-length", "16", "--reasoning-parser", "qwen3"]
    args += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
    yield from _shared(lambda: spawn_server(tiny_model("qwen3"), args, log))


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
