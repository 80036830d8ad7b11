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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli import add_no_bracket_option, add_run_options, base_parser, parse_run_args  # noqa: E402
from machine import machine_note, set_threads  # noqa: E402
from models import model_label, resolve_bench_model  # noqa: E402
from phases import Phases, Request, ideal_prefill_tokens, max_seq_len, total_kv_tokens  # noqa: E402
from processes import exit_on_sigterm  # noqa: E402
from report import Panel, format_table, log, series, stamp, write_chart_and_json  # noqa: E402
from results import RunResult, median_run  # noqa: E402
from runners.minisgl import MinisglRunner  # noqa: E402
from runners.vllm import PeerRun, run_vllm_peer  # noqa: E402
from workloads import PREFIX_WORKLOADS, QUICK_PREFIX_WORKLOADS, TokenSource  # noqa: E402

from minisgl.llm import LLM  # noqa: E402


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


def warmup_phases(tokens: TokenSource) -> Phases:
    """A small untimed run: a few short prompts, a few new tokens each."""
    rng = tokens.rng("warmup")
    return [[Request(tokens.draw(rng, 64), 4) for _ in range(4)]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see --help)."""
    p = base_parser(__doc__)
    p.add_argument(
        "--workloads", default=",".join(PREFIX_WORKLOADS), help="comma-separated: P1,P2,P3,agent"
    )
    p.add_argument(
        "--configs",
        default=None,
        help="minisgl configs to run (default all available): naive,radix,radix+lpm",
    )
    p.add_argument("--vllm-block-size", type=int, default=None, help="vLLM KV block size")
    p.add_argument("--quick", action="store_true", help="smaller shapes: a smoke test, < 1 minute")
    add_no_bracket_option(p, " with a peer: also again after it")
    add_run_options(p)
    return parse_run_args(p, argv)


def report(
    results: list[RunResult], ideal: dict[str, int], args: argparse.Namespace, model: Path
) -> None:
    """The table of prompt tokens computed, hit rate and speedup over naive; PNG and JSON."""
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
    groups = list(ideal)
    panels = [
        Panel(
            groups,
            series(results, groups, lambda r: r.wall_s),
            "wall s",
            "wall time (lower is better)",
        ),
        Panel(
            groups,
            series(results, groups, lambda r: r.prefill_computed),
            "prompt tokens computed",
            "prefill tokens computed",
            bounds=[ideal[g] for g in groups],
            bound_label="ideal",
        ),
    ]
    png = args.out / f"prefix-{model_label(model)}-{stamp()}.png"
    title = f"prefix sharing: {model_label(model)} {args.dtype}"
    write_chart_and_json(png, title, panels, results)


def main(argv: list[str] | None = None) -> None:
    """Run every workload on minisgl's configs (and the peer) and print the table."""
    args = parse_args(argv)
    exit_on_sigterm()
    table = QUICK_PREFIX_WORKLOADS if args.quick else PREFIX_WORKLOADS
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
            out_dir=args.out,
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
