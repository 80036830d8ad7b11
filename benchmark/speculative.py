"""Speculative decoding: decode tokens/s with n-gram drafts against without, on real prompts.

Prompt kinds (chat-templated, greedy, each request's prompt different): `edit` a code file of
this repository with a rename asked for, `document` a passage with a question answered from it,
`rewrite` a paragraph to copy with one change, `chat` open questions. For each kind and batch
size, every prompt is first prefilled into the radix cache (one token), so the timed run is
decode: output tokens / seconds, speculation off and on, in one invocation with the same
engine settings, each timed `--repeat` times (3), off and on alternated, medians reported (a
shared VM's speed moves by up to 2x between runs a few seconds apart). Acceptance: mean tokens
per verify step and the share of drafts kept, over the runs. Figures only: nothing is asserted.

With `--draft-model PATH` a draft model of the same vocabulary (STANDALONE) runs too, its
columns beside n-gram's; its engine runs each batch once before the timed run, so that the
draft's own prefix cache holds the prompts too (as a conversation's earlier turns would).
With `--peer llamacpp` (scripts/setup_llamacpp.sh builds it), llama.cpp's prompt lookup
decoding (`llama-lookup`, one sequence) generates from the same GGUF file and the same chat-templated
prompt of each kind, without drafts and with as many as ours, for a second table (batch 1).
With `--peer vllm` (scripts/setup_vllm.sh), vLLM's CPU backend serves the model's HF folder in
bf16 on the same prompts and batch sizes, without speculation and with its n-gram drafting
(`speculative_config` method "ngram", as many draft tokens and the same longest match), its
prompts prefilled into its prefix cache first; a peer that cannot speculate on a CPU says so.

    python benchmark/speculative.py                       # default model, batch 1, 4, 16
    python benchmark/speculative.py --batch-sizes 1 --kinds edit,chat --max-tokens 64
    python benchmark/speculative.py --batch-sizes 1 --peer llamacpp
    python benchmark/speculative.py --peer vllm
    python benchmark/speculative.py --model qwen3-0.6b-random --draft-model DRAFT_DIR
    python benchmark/speculative.py --model MODEL_DIR --draft-model self --draft-quantization int4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paths  # noqa: E402,F401  (before minisgl: a checkout without `pip install -e .`)
import torch  # noqa: E402
from machine import machine_note, set_threads  # noqa: E402
from models import model_label, model_source, resolve_bench_model  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("edit", "document", "rewrite", "chat")
SOURCES = sorted((ROOT / "python" / "minisgl").rglob("*.py"))
RENAMES = ["req", "batch", "tokens", "config", "state", "output", "engine", "cache"]
# Fixed text (an old version of the serving docs), so figures stay comparable as docs change.
DOCUMENT = (ROOT / "benchmark" / "data" / "document.md").read_text()
QUESTIONS = [
    "What are the two commands a newcomer runs first?",
    "Which Python version do the commands need?",
    "Where is the default model prepared?",
    "How do you start the API server on another port?",
    "Which radix eviction policies can be chosen?",
    "What does the test command run?",
    "How is the shell started?",
    "Where do weights live?",
]
TOPICS = [
    "the history of the bicycle",
    "why the sky is blue",
    "how bread rises",
    "what makes a good friend",
    "the life of a honeybee",
    "how volcanoes form",
    "a day at the beach",
    "learning to play the piano",
]


def code_chunk(index: int, chars: int = 1800) -> str:
    text = SOURCES[index % len(SOURCES)].read_text()
    return text[:chars].rsplit("\n", 1)[0]


def messages(kind: str, index: int) -> list[dict[str, str]]:
    if kind == "edit":
        name = RENAMES[index % len(RENAMES)]
        code = code_chunk(index * 7 + 3)
        ask = f"Rewrite this code with the variable `{name}` renamed to `{name}_new`. Output only "
        return [{"role": "user", "content": f"{ask}the code.\n\n```python\n{code}\n```"}]
    if kind == "document":
        start = (index * 900) % max(1, len(DOCUMENT) - 2500)
        passage = DOCUMENT[start : start + 2500]
        question = QUESTIONS[index % len(QUESTIONS)]
        ask = f"Answer from the document, quoting it.\n\n{passage}\n\nQuestion: {question}"
        return [{"role": "user", "content": ask}]
    if kind == "rewrite":
        start = (index * 1300 + 400) % max(1, len(DOCUMENT) - 1500)
        paragraph = DOCUMENT[start : start + 1200]
        ask = "Repeat the following text exactly, but write 'minisgl' as 'MiniSGL':\n\n"
        return [{"role": "user", "content": ask + paragraph}]
    topic = TOPICS[index % len(TOPICS)]
    return [{"role": "user", "content": f"Tell me about {topic}."}]


def prompts(llm: LLM, kind: str, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        ids = llm.tokenizer.apply_chat_template(messages(kind, i), add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def decode_run(llm: LLM, ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(output tokens / second, outputs) of one greedy generate whose prompts are cached. The
    prefix cache is emptied first: what earlier kinds left in it (their shared chat-template
    start) changed how a quantized model prefilled these prompts, and with it their greedy
    texts, so a kind's figures depended on which kinds ran before it (chat at batch 1: 1.26x
    after the others, 0.95x alone)."""
    llm.cache_manager.flush()
    llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)  # prefill into the tree
    params = SamplingParams(max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o["token_ids"] for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or name (default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed runs of each engine per kind and batch, alternated (medians reported)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--peer", choices=["llamacpp", "vllm"], default=None)
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a draft model of the model's vocabulary: STANDALONE's columns beside NGRAM's "
        "(`self`: the model's own folder, with --draft-quantization a quantized copy)",
    )
    parser.add_argument(
        "--draft-quantization",
        default=None,
        help="the draft model's --speculative-draft-model-quantization (int4, int8, ...)",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    set_threads(args.threads)
    # The default model as LLM() serves it (its GGUF, quantized, where one is prepared).
    model = model_source(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown --kinds {sorted(unknown)}; choose from {list(KINDS)}")
    common = dict(dtype=args.dtype, max_running_req=max(batch_sizes))
    plain = LLM(model, **common)
    spec = LLM(
        model,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=args.num_draft_tokens,
        **common,
    )
    drafting = None
    if args.draft_model:
        drafting = LLM(
            model,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(plain.config.gguf_path or plain.model_path)
            if args.draft_model == "self"
            else model_source(args.draft_model),
            speculative_draft_model_quantization=args.draft_quantization,
            speculative_num_draft_tokens=args.num_draft_tokens,
            **common,
        )
    engines = [plain, spec] + ([drafting] if drafting is not None else [])
    for llm in engines:  # warm-up: kernels, buffers, the cost model's first steps
        llm.generate(prompts(llm, "chat", 2), SamplingParams(max_tokens=16), use_tqdm=False)
    label = model_label(plain.model_path) + (" (GGUF)" if plain.config.gguf_path else "")
    print(
        f"# speculative decoding: {label}, {plain.config.quantization or args.dtype}, greedy, "
        f"{args.max_tokens} new tokens; {machine_note()}"
    )
    header = (
        "| kind | batch | off tok/s | ngram tok/s | ratio | tokens/verify | drafts kept | equal "
        "| tokens/step, own-text bound |"
    )
    if drafting is not None:
        header += " draft model tok/s | ratio | tokens/verify | drafts kept | equal |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for kind in kinds:
        for batch in batch_sizes:
            ids = prompts(plain, kind, batch)
            for llm in engines[1:]:
                if llm.speculator is not None and llm.speculator.drafter is not None:
                    # Its prefix cache takes a request's draft KV when the request ends.
                    llm.generate(ids, SamplingParams(max_tokens=args.max_tokens), use_tqdm=False)
            # Off and each speculating engine alternated, so that the machine's slow and fast
            # spells (up to 2x on a shared VM) fall on all of them alike.
            runs: list[list[Run]] = [[] for _ in engines]
            for _ in range(args.repeat):
                for llm, measured in zip(engines, runs):
                    measured.append(timed_run(llm, ids, args.max_tokens))
            off_rate = statistics.median(run.rate for run in runs[0])
            cells = [kind, str(batch), f"{off_rate:.1f}"]
            for measured in runs[1:]:
                cells += speculating_cells(measured, off_rate, runs[0][0].tokens)
                if measured is runs[1]:
                    cells.append(step_cells(measured[0], ids, args.num_draft_tokens - 1))
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.peer == "llamacpp":
        llamacpp_table(plain, kinds, args)
    if args.peer == "vllm":
        vllm_table(plain, kinds, batch_sizes, args)
    for llm in engines:
        llm.shutdown()


@dataclass
class Run:
    """One timed greedy generate: output tokens/s, outputs, and the speculation counters' deltas
    (verify steps, drafts, accepted drafts)."""

    rate: float
    tokens: list[list[int]]
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0


def timed_run(llm: LLM, ids: list[list[int]], max_tokens: int) -> Run:
    """A decode_run, with what speculation did in it. The shared n-gram cache is emptied first:
    it would hold these prompts' outputs from the runs before (and the first prompts' from the
    smaller batches), and draft them whole."""
    if llm.speculator is None:
        return Run(*decode_run(llm, ids, max_tokens))
    llm.speculator.cache.clear()
    before = dict(vars(llm.speculator.stats))
    rate, tokens = decode_run(llm, ids, max_tokens)
    after = vars(llm.speculator.stats)
    return Run(
        rate,
        tokens,
        after["verify_steps"] - before["verify_steps"],
        after["draft_tokens"] - before["draft_tokens"],
        after["accepted_tokens"] - before["accepted_tokens"],
    )


def speculating_cells(runs: list[Run], off_rate: float, off_tokens: list[list[int]]) -> list[str]:
    """Median tok/s, its ratio to off's median, tokens per verify step, drafts kept (over all
    runs) and whether every run's tokens equal off's."""
    rate = statistics.median(run.rate for run in runs)
    steps = sum(run.verify_steps for run in runs)
    drafted = sum(run.drafted for run in runs)
    accepted = sum(run.accepted for run in runs)
    return [
        f"{rate:.1f}",
        f"{rate / off_rate:.2f}x",
        f"{1 + accepted / steps:.2f}" if steps else "-",
        f"{accepted / drafted:.0%}" if drafted else "-",
        "yes" if all(run.tokens == off_tokens for run in runs) else "no",
    ]


def ngram_bound_steps(prompt: list[int], output: list[int], max_drafts: int, max_n: int) -> int:
    """Decode steps of `output` if every step kept the longest run that some earlier occurrence
    of the text's last n tokens (1 <= n <= max_n, prompt and output so far) continued with, up
    to `max_drafts`, plus its next token: a bound on single-branch n-gram drafts from a
    request's own text (the engine picks one occurrence before seeing the target's tokens)."""
    text = list(prompt)
    followers: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)

    def index(first: int) -> None:  # n-grams ending before positions first..len(text)-1
        for end in range(max(first, 1), len(text)):
            for n in range(1, min(max_n, end) + 1):
                followers[tuple(text[end - n : end])].append(end)

    index(1)
    steps = done = 0
    while done < len(output):
        best = 0
        for n in range(1, min(max_n, len(text)) + 1):
            for start in followers.get(tuple(text[len(text) - n :]), ()):
                run = 0
                while (
                    run < max_drafts
                    and start + run < len(text)
                    and done + run < len(output)
                    and text[start + run] == output[done + run]
                ):
                    run += 1
                best = max(best, run)
        taken = min(best + 1, len(output) - done)
        known = len(text)
        text += output[done : done + taken]
        index(known)
        done += taken
        steps += 1
    return steps


def step_cells(run: Run, ids: list[list[int]], max_drafts: int, max_n: int = 6) -> str:
    """Output tokens per decode step of one speculating run (a request's step yields its kept
    drafts and one token), beside ngram_bound_steps's for the same outputs."""
    tokens = sum(map(len, run.tokens))
    bound = sum(
        ngram_bound_steps(prompt, out, max_drafts, max_n) for prompt, out in zip(ids, run.tokens)
    )
    return f"{tokens / (tokens - run.accepted):.2f} / {tokens / bound:.2f}"


def llamacpp_table(llm: LLM, kinds: list[str], args: argparse.Namespace) -> None:
    """llama.cpp's prompt lookup decoding on the served GGUF, each kind's first prompt."""
    from runners.llamacpp import lookup_decode

    gguf = llm.config.gguf_path
    if gguf is None:
        print("# --peer llamacpp: the model is not a GGUF file; nothing to compare")
        return
    threads = torch.get_num_threads()
    print(f"\n# llama.cpp llama-lookup on {Path(gguf).name}, greedy, batch 1, {threads} threads")
    print("| kind | off tok/s | lookup tok/s | ratio | tokens/step | drafts kept |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        text = llm.tokenizer.decode(prompts(llm, kind, 1)[0])
        off = lookup_decode(Path(gguf), text, args.max_tokens, threads, 0)
        on = lookup_decode(Path(gguf), text, args.max_tokens, threads, args.num_draft_tokens - 1)
        steps = on.decoded - on.accepted
        per_step = f"{on.decoded / steps:.2f}" if steps > 0 else "-"
        kept = f"{on.accepted / on.drafted:.0%}" if on.drafted else "-"
        print(
            f"| {kind} | {off.tokens_per_s:.1f} | {on.tokens_per_s:.1f} | "
            f"{on.tokens_per_s / off.tokens_per_s:.2f}x | {per_step} | {kept} |",
            flush=True,
        )


def vllm_table(
    llm: LLM, kinds: list[str], batch_sizes: list[int], args: argparse.Namespace
) -> None:
    """vLLM's CPU backend, speculation off and n-gram, each an engine of its own, on the same
    prompts (token ids, greedy, EOS ignored), all of them prefilled into its prefix cache first."""
    from phases import Request
    from runners.vllm import PeerRun, run_vllm_peer

    folder = resolve_bench_model(args.model)
    if not (folder / "config.json").exists() or not any(folder.glob("*.safetensors")):
        print(f"# --peer vllm: {folder} holds no safetensors weights; nothing to compare")
        return
    batches = {(kind, b): prompts(llm, kind, b) for kind in kinds for b in batch_sizes}
    # A kind's prompts are the same first ones at every batch size: its largest batch holds all.
    widest = [prompts(llm, kind, max(batch_sizes)) for kind in kinds]
    warmup = [[Request(ids, 1) for batch in widest for ids in batch]]
    runs = [
        PeerRun(f"{kind}-{b}", [[Request(ids, args.max_tokens) for ids in batch]])
        for (kind, b), batch in batches.items()
    ]
    longest = max(len(ids) for batch in batches.values() for ids in batch)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.num_draft_tokens - 1,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 6,
    }
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    results = {}
    for name, config in (("off", None), ("ngram", ngram)):
        results[name] = run_vllm_peer(
            folder,
            dtype,
            runs,
            warmup,
            max_model_len=longest + args.max_tokens + 16,
            enable_prefix_caching=True,
            speculative_config=config,
            threads=args.threads,
        )
    off, on = results["off"], results["ngram"]
    if off is None:
        return
    print(f"\n# vLLM CPU on {folder.name} ({dtype}), greedy, EOS ignored, n-gram drafts")
    print("| kind | batch | off tok/s | ngram tok/s | ratio |")
    print("|---|---|---|---|---|")
    for i, run in enumerate(runs):
        off_rate = off[i].output_tokens / off[i].wall_s
        cells = [*run.name.rsplit("-", 1), f"{off_rate:.1f}"]
        if on is None:
            cells += ["not run (vLLM refused speculation; its log above)", "-"]
        else:
            on_rate = on[i].output_tokens / on[i].wall_s
            cells += [f"{on_rate:.1f}", f"{on_rate / off_rate:.2f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
