"""Prefix sharing: minisgl's naive vs radix cache (fcfs vs lpm), optionally vLLM's prefix cache.

Workloads (shared/PEERS.md; random token ids, never special tokens, fresh per run and the same
for every engine; greedy, EOS ignored, every request generates exactly its output length):
- P1 shared system prompt: one 1024-token system prompt + 64 different 32-token questions
  (1056-token prompts), 32 new tokens each; the first request alone, then the other 63 at once.
- P2 multi-turn chat: 16 conversations x 4 turns in lockstep. Turn 1 = a 256-token history;
  each turn generates 48 tokens; the next prompt = previous prompt + those 48 tokens + a new
  32-token user message (prompts of 256, 336, 416, 496 tokens).
- P3 control: 64 distinct 1056-token prompts, 32 new tokens, nothing shared.
- agent: 8 agents x 6 steps in lockstep. Step 1 = a shared 512-token system prompt (tool
  definitions) + a 64-token task; each step generates a 32-token tool call, then the next
  prompt = previous prompt + the call + a 128-token tool output (prompts of 576 ... 1376).

Per run it reports the prompt tokens the engine actually computed (minisgl: counted at each
prefill forward; vLLM: prompt - cached), what a perfect token-level cache would compute, the
cache hit rate, wall time (the sum of the `generate` calls, one per phase) and the speedup over
minisgl's naive cache. minisgl's configs are loaded together and take turns on each workload
(reversed every other repeat: with --repeat 3, naive radix radix naive naive radix), so radix
vs naive is measured side by side. With --peer vllm, minisgl's configs run before the peer and
again after it, and each figure is the median over both sessions (--no-bracket: before only).
Prints a Markdown table; writes a PNG and a JSON under benchmark/out/. Figures only: nothing is
asserted.

    python benchmark/prefix.py                     # all workloads, default model, bf16
    python benchmark/prefix.py --workloads P1,P3 --peer vllm --vllm-block-size 32
    python benchmark/prefix.py --quick             # smaller shapes, < 1 minute
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    LLM,
    MinisglRunner,
    Panel,
    PeerRun,
    Phases,
    Request,
    RunResult,
    TokenSource,
    add_run_options,
    bar_chart,
    base_parser,
    exit_on_sigterm,
    format_table,
    ideal_prefill_tokens,
    machine_note,
    max_seq_len,
    median_run,
    model_label,
    parse_run_args,
    resolve_bench_model,
    run_vllm_peer,
    save_json,
    set_threads,
    stamp,
    total_kv_tokens,
)


# ---------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class SharedPrompt:
    """P1: `first` request alone, then the rest; every prompt = system + own question."""

    system: int = 1024
    questions: int = 64
    question: int = 32
    output: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        rng = tokens.rng("P1", *stream)
        system = tokens.draw(rng, self.system)
        reqs = [
            Request(system + tokens.draw(rng, self.question), self.output)
            for _ in range(self.questions)
        ]
        return [reqs[:1], reqs[1:]]


@dataclass(frozen=True)
class MultiTurn:
    """P2: conversations in lockstep; each turn continues the previous one with new ids."""

    conversations: int = 16
    turns: int = 4
    history: int = 256
    output: int = 48
    user: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        rng = tokens.rng("P2", *stream)
        phases = [[Request(tokens.draw(rng, self.history), self.output)]]
        phases[0] += [
            Request(tokens.draw(rng, self.history), self.output)
            for _ in range(self.conversations - 1)
        ]
        for _ in range(self.turns - 1):
            phases.append(
                [
                    Request(tokens.draw(rng, self.user), self.output, base=i)
                    for i in range(self.conversations)
                ]
            )
        return phases


@dataclass(frozen=True)
class Distinct:
    """P3: distinct prompts, nothing shared, all at once."""

    prompts: int = 64
    length: int = 1056
    output: int = 32

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        rng = tokens.rng("P3", *stream)
        return [[Request(tokens.draw(rng, self.length), self.output) for _ in range(self.prompts)]]


@dataclass(frozen=True)
class Agent:
    """Agents in lockstep: shared system prompt + task, then tool call + tool output per step."""

    agents: int = 8
    steps: int = 6
    system: int = 512
    task: int = 64
    output: int = 32
    tool: int = 128

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        rng = tokens.rng("agent", *stream)
        system = tokens.draw(rng, self.system)
        phases = [[Request(system + tokens.draw(rng, self.task), self.output)]]
        phases[0] += [
            Request(system + tokens.draw(rng, self.task), self.output)
            for _ in range(self.agents - 1)
        ]
        for _ in range(self.steps - 1):
            phases.append(
                [
                    Request(tokens.draw(rng, self.tool), self.output, base=i)
                    for i in range(self.agents)
                ]
            )
        return phases


Workload = SharedPrompt | MultiTurn | Distinct | Agent
WORKLOADS: dict[str, Workload] = {
    "P1": SharedPrompt(),
    "P2": MultiTurn(),
    "P3": Distinct(),
    "agent": Agent(),
}
QUICK_WORKLOADS: dict[str, Workload] = {
    "P1": SharedPrompt(system=128, questions=8, question=16, output=4),
    "P2": MultiTurn(conversations=4, turns=3, history=32, output=4, user=8),
    "P3": Distinct(prompts=8, length=144, output=4),
    "agent": Agent(agents=2, steps=3, system=64, task=16, output=4, tool=16),
}


# ---------------------------------------------------------------------------- engines
def minisgl_configs(only: list[str] | None) -> list[tuple[str, dict[str, Any]]]:
    """naive and radix, plus radix with the lpm policy when `LLM` takes a schedule_policy."""
    has_policy = "schedule_policy" in inspect.signature(LLM.__init__).parameters
    configs: list[tuple[str, dict[str, Any]]] = [
        ("naive", dict(cache_type="naive")),
        ("radix", dict(cache_type="radix")),
    ]
    if has_policy:
        for _, kwargs in configs:
            kwargs["schedule_policy"] = "fcfs"
        configs.append(("radix+lpm", dict(cache_type="radix", schedule_policy="lpm")))
    else:
        log("note: LLM has no schedule_policy argument: fcfs vs lpm is skipped")
    if only:
        unknown = set(only) - {name for name, _ in configs}
        if unknown:
            log(f"note: unavailable minisgl configs skipped: {sorted(unknown)}")
        configs = [c for c in configs if c[0] in only]
    return configs


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warmup_phases(tokens: TokenSource) -> Phases:
    """A small untimed run: a few short prompts, a few new tokens each."""
    rng = tokens.rng("warmup")
    return [[Request(tokens.draw(rng, 64), 4) for _ in range(4)]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: P1,P2,P3,agent"
    )
    p.add_argument(
        "--configs",
        default=None,
        help="minisgl configs to run (default all available): naive,radix,radix+lpm",
    )
    p.add_argument("--vllm-block-size", type=int, default=None, help="vLLM KV block size")
    p.add_argument("--quick", action="store_true", help="smaller shapes: a smoke test, < 1 minute")
    p.add_argument(
        "--no-bracket",
        action="store_true",
        help="run minisgl once, first (default with a peer: also again after it, median of both)",
    )
    add_run_options(p)
    return parse_run_args(p, argv)


def report(
    results: list[RunResult], ideal: dict[str, int], args: argparse.Namespace, model: Path
) -> None:
    rows = []
    for wname in ideal:
        base = next((r for r in results if r.workload == wname and r.engine == "naive"), None)
        for r in (r for r in results if r.workload == wname):
            speedup = None if base is None else f"{base.wall_s / r.wall_s:.2f}x"
            rows.append(
                [
                    wname,
                    r.engine,
                    r.wall_s,
                    r.prompt_tokens,
                    r.prefill_computed,
                    ideal[wname],
                    f"{100 * r.hit_rate:.1f}%",
                    speedup,
                    r.bad_lengths or "",
                ]
            )
    headers = [
        "workload",
        "engine",
        "wall s",
        "prompt tok",
        "prefill computed",
        "ideal",
        "hit rate",
        "vs naive",
        "bad len",
    ]
    print(format_table(headers, rows))
    print(
        "ideal = prompt tokens a cache reusing every token from earlier phases would compute; "
        "vs naive = naive wall / this wall."
    )
    engines = list(dict.fromkeys(r.engine for r in results))
    groups = list(ideal)

    def series(value: Callable[[RunResult], float | None]) -> dict[str, list[float | None]]:
        return {
            e: [
                next((value(r) for r in results if r.engine == e and r.workload == g), None)
                for g in groups
            ]
            for e in engines
        }

    panels = [
        Panel(groups, series(lambda r: r.wall_s), "wall s", "wall time (lower is better)"),
        Panel(
            groups,
            series(lambda r: r.prefill_computed),
            "prompt tokens computed",
            "prefill tokens computed",
            bounds=[ideal[g] for g in groups],
            bound_label="ideal",
        ),
    ]
    png = args.out / f"prefix-{model_label(model)}-{stamp()}.png"
    title = f"prefix sharing: {model_label(model)} {args.dtype}"
    if bar_chart(png, title, panels):
        print(f"plot: {png}")
    save_json(png.with_suffix(".json"), [r.to_json() for r in results])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"unknown workload(s) {unknown}; choose from {list(table)}")
    workloads = {n: table[n] for n in names}
    model = resolve_bench_model(args.model)
    tokens = TokenSource(model, args.seed)
    set_threads(args.threads)
    print(f"# prefix benchmark: {model_label(model)} ({model}), {args.dtype}")
    print(f"# machine: {machine_note()}")
    samples = {n: w.phases(tokens, 0) for n, w in workloads.items()}
    seq_len = max(max_seq_len(p) for p in samples.values())
    kv_tokens = max(total_kv_tokens(p) for p in samples.values()) + 64
    ideal = {n: ideal_prefill_tokens(p) for n, p in samples.items()}

    def minisgl_runs() -> dict[tuple[str, str], list[RunResult]]:
        """--repeat runs of every workload on every config. The configs' engines are loaded
        together and take turns (in reverse order every other repeat), so a ratio between them
        (radix vs naive) is measured on the same machine, not minutes apart."""
        runners: dict[str, MinisglRunner] = {}
        for name, kwargs in minisgl_configs(args.configs.split(",") if args.configs else None):
            log(f"minisgl {name}: loading")
            try:
                runners[name] = MinisglRunner(
                    model,
                    args.dtype,
                    name=name,
                    max_seq_len=seq_len,
                    kv_tokens=kv_tokens,
                    page_size=args.page_size,
                    **kwargs,
                )
            except (TypeError, ValueError) as exc:
                log(f"minisgl {name}: skipped ({exc})")
                continue
            runners[name].run(warmup_phases(tokens), "warmup")
        runs: dict[tuple[str, str], list[RunResult]] = {
            (name, wname): [] for name in runners for wname in workloads
        }
        try:
            for wname, workload in workloads.items():
                for r in range(args.repeat):
                    turn = list(runners.items()) if r % 2 == 0 else list(runners.items())[::-1]
                    for name, runner in turn:
                        result = runner.run(workload.phases(tokens, r), wname)
                        result.extra.pop("outputs", None)
                        runs[(name, wname)].append(result)
                for name in runners:
                    done = runs[(name, wname)]
                    walls = ", ".join(f"{run.wall_s:.2f}" for run in done)
                    log(f"  {name} {wname}: {walls} s, computed {done[0].prefill_computed} tokens")
        finally:
            for runner in runners.values():
                runner.close()
        return runs

    ours = minisgl_runs()
    results: list[RunResult] = []
    if "vllm" in args.peer:
        runs = [
            PeerRun(n, w.phases(tokens, r), r)
            for n, w in workloads.items()
            for r in range(args.repeat)
        ]
        peer = run_vllm_peer(
            model,
            args.dtype,
            runs,
            warmup_phases(tokens),
            max_model_len=max(1024, seq_len),
            enable_prefix_caching=True,
            block_size=args.vllm_block_size,
            kv_gb=args.vllm_kv_gb,
            threads=args.threads,
            log=log,
        )
        if peer is None:
            print("vLLM peer: ABSENT or failed (see above); its rows are missing.")
        else:
            for n in workloads:
                results.append(median_run([r for r in peer if r.workload == n]))
    # With a peer, minisgl runs again after it: the machine's speed drifts over minutes, and
    # the median of both sessions (the slower middle run for an even count) favours no side.
    bracket = bool(results) and not args.no_bracket
    if bracket:
        log("minisgl: again, after the peer (the machine's speed drifts)")
        again = minisgl_runs()
        ours = {key: runs + again.get(key, []) for key, runs in ours.items()}
    ours_best = [median_run(runs, upper=bracket) for runs in ours.values()]
    report(ours_best + results, ideal, args, model)


if __name__ == "__main__":
    main()
