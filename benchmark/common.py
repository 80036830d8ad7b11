"""Shared helpers for the benchmarks: models, random-token workloads, engine runners, output.

Every engine sees the same workload: requests grouped into *phases*. A phase is submitted at once
and must finish before the next starts; a request of a later phase may continue an earlier
request (its prompt is that request's prompt + generated tokens + new ids), which is how
multi-turn and agent workloads are expressed. Offline workloads are a single phase.

Engines: minisgl in this process (`MinisglRunner`), Hugging Face transformers `generate` in this
process (`HFRunner`), and peers in their own venvs (`run_vllm_peer`, through
`benchmark/peers/vllm_offline.py`). Benchmarks print figures; they never assert on speed.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "python"))

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.layers.linear import onednn_pack  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.llm.llm import parse_dtype  # noqa: E402
from minisgl.utils.hf import cache_dir, resolve_model_path  # noqa: E402

OUT_DIR = REPO_ROOT / "benchmark" / "out"
PEERS_DIR = REPO_ROOT / ".peers"
VLLM_RUNNER = REPO_ROOT / "benchmark" / "peers" / "vllm_offline.py"

QWEN3_RANDOM = "qwen3-0.6b-random"
# Qwen3-0.6B's shape (random weights): q/k RMSNorm come with the Qwen3 architecture.
QWEN3_0_6B_CONFIG: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
RANDOM_MODEL_SEED = 0


def available_cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def engine_threads() -> int:
    """The thread count in-process engines use: MINISGL_NUM_THREADS or one per core."""
    from minisgl.env import ENV

    return ENV.NUM_THREADS.value or len(available_cores())


def set_threads(threads: int | None) -> int:
    """Give every in-process engine `threads` CPU threads (None: one per available core)."""
    from minisgl.env import ENV

    n = threads or len(available_cores())
    ENV.NUM_THREADS.value = n  # read by minisgl's engine when it starts
    torch.set_num_threads(n)
    return n


# ---------------------------------------------------------------------------- models
def build_random_qwen3(seed: int = RANDOM_MODEL_SEED) -> Path:
    """A Qwen3-0.6B-shaped bf16 model with random weights and the default model's tokenizer.

    Built once (fixed seed) into `cache_dir()/bench-models/`; later calls return the folder.
    """
    import transformers

    spec = json.dumps([QWEN3_0_6B_CONFIG, seed, "bf16"], sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    target = cache_dir() / "bench-models" / f"{QWEN3_RANDOM}-{digest}"
    if (target / "config.json").exists():
        return target
    print(f"building {QWEN3_RANDOM} (random weights, seed {seed}) into {target}", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = transformers.Qwen3Config(**QWEN3_0_6B_CONFIG, **special)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    del model
    gc.collect()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: a half-written folder is never taken as done
    return target


def resolve_bench_model(name: str | None) -> Path:
    """`None`/"default": the default model; `qwen3-0.6b-random`; else any HF folder or GGUF."""
    if name is None or name == "default":
        return resolve_model_path(None)
    if name == QWEN3_RANDOM:
        return build_random_qwen3()
    return resolve_model_path(name)


def model_label(path: Path) -> str:
    """A short name for tables and file names."""
    name = path.name
    return QWEN3_RANDOM if name.startswith(QWEN3_RANDOM) else name


@dataclass(frozen=True)
class Machine:
    """The two figures a roofline needs: memory read bandwidth and matmul peak (in the dtype the
    model runs in; PEERS.md's reference figures are bf16's)."""

    bandwidth_gbs: float
    matmul_tflops: float
    source: str

    def describe(self) -> str:
        return f"{self.bandwidth_gbs:.1f} GB/s, {self.matmul_tflops:.2f} TFLOP/s ({self.source})"


# shared/PEERS.md's machine (2-core Zen 5), on which the issues' absolute figures were set.
REFERENCE_MACHINE = Machine(35.0, 0.97, "the 2-core Zen 5 of shared/PEERS.md")


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(dtype: torch.dtype = torch.bfloat16) -> Machine:
    """Measure this machine (about two seconds, with torch's current thread count).

    Bandwidth: a float32 sum over 1 GiB, far beyond any cache. Peak: oneDNN's matmul in `dtype`
    (a packed 2,048 x 2,048 weight, as the engine multiplies on CPU; F.linear where oneDNN cannot
    pack the dtype) on operands that fit in cache. Each is the best of several runs, since a
    bound should not be beaten.
    """
    data = torch.ones(1 << 28, dtype=torch.float32)
    bandwidth = data.numel() * 4 / _best_seconds(data.sum, 5) / 1e9
    del data
    x = torch.randn(512, 2048, dtype=dtype)
    weight = torch.randn(2048, 2048, dtype=dtype)
    packed = onednn_pack(weight)

    def matmul() -> object:
        if packed is None:
            return torch.nn.functional.linear(x, weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    seconds = _best_seconds(lambda: [matmul() for _ in range(4)], 5) / 4
    tflops = 2 * x.shape[0] * x.shape[1] * weight.shape[0] / seconds / 1e12
    name = str(dtype).removeprefix("torch.")
    return Machine(bandwidth, tflops, f"measured here, {name}, {torch.get_num_threads()} threads")


@dataclass(frozen=True)
class ModelCost:
    """What one token / one decode step costs the machine, for roofline bounds."""

    params: int
    weight_bytes: int  # bytes read from memory by one decode step (weights only)
    flops_per_token: int  # matmul FLOPs of one token that gets logits (attention excluded)
    head_flops: int  # of which the output head's (prompt tokens before the last skip it)

    def bandwidth_steps_per_s(self, machine: Machine) -> float:
        """Decode steps/s if every step streams the weights once at the machine's bandwidth."""
        return machine.bandwidth_gbs * 1e9 / self.weight_bytes

    def compute_tok_per_s(self, machine: Machine) -> float:
        """Tokens/s if the matmuls ran at the machine's peak."""
        return machine.matmul_tflops * 1e12 / self.flops_per_token

    def roofline_tok_per_s(self, batch: int, machine: Machine) -> float:
        """Decode tok/s bound at a batch size: the lower of the bandwidth and compute bounds."""
        return min(batch * self.bandwidth_steps_per_s(machine), self.compute_tok_per_s(machine))

    def matmul_seconds(
        self, prompt_tokens: int, requests: int, output_tokens: int, machine: Machine
    ) -> float:
        """Least time for a workload's matmuls at the machine's peak. The layers see every
        prompt token and every output token but each request's last; the head makes every
        output token."""
        layer_flops = self.flops_per_token - self.head_flops
        tokens = prompt_tokens + output_tokens - requests
        flops = tokens * layer_flops + output_tokens * self.head_flops
        return flops / (machine.matmul_tflops * 1e12)


def model_cost(path: Path, dtype: torch.dtype) -> ModelCost:
    """Count parameters on the meta device (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embed = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # With tied embeddings the embedding matrix is the lm_head matmul; untied, the input
    # embedding is a row lookup that neither streams the matrix nor multiplies it.
    matmul_params = params if tied else params - embed
    head = model.get_output_embeddings().weight.numel()
    element = torch.empty((), dtype=dtype).element_size()
    return ModelCost(params, matmul_params * element, 2 * matmul_params, 2 * head)


# ---------------------------------------------------------------------------- token ids
class TokenSource:
    """Random token ids that are never special or added tokens, from seeded streams."""

    def __init__(self, model_path: Path, seed: int) -> None:
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        vocab = min(len(tokenizer), AutoConfig.from_pretrained(str(model_path)).vocab_size)
        excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.allowed = np.array([i for i in range(vocab) if i not in excluded], dtype=np.int64)
        self.seed = seed

    def rng(self, *stream: int | str) -> np.random.Generator:
        """An independent generator per (seed, stream...): same ids for every engine."""
        key = [self.seed] + [
            int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) if isinstance(s, str) else s
            for s in stream
        ]
        return np.random.default_rng(key)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), n)].tolist()


# ---------------------------------------------------------------------------- workloads
@dataclass
class Request:
    """One request of a phase: continue `base` (index in the previous phase) with `ids`."""

    ids: list[int]
    max_tokens: int
    base: int | None = None


Phases = list[list[Request]]


def phases_to_json(phases: Phases) -> list[list[dict[str, Any]]]:
    return [[asdict(r) for r in phase] for phase in phases]


def single_phase(prompts: Sequence[list[int]], output_lens: Sequence[int]) -> Phases:
    return [[Request(list(p), n) for p, n in zip(prompts, output_lens)]]


def phase_prompt_lens(phases: Phases) -> list[list[int]]:
    """Prompt lengths per phase, assuming each request generates exactly its max_tokens."""
    lens: list[list[int]] = []
    for k, phase in enumerate(phases):
        row = []
        for r in phase:
            base = 0
            if r.base is not None:
                assert k > 0, "the first phase cannot continue a request"
                base = lens[k - 1][r.base] + phases[k - 1][r.base].max_tokens
            row.append(base + len(r.ids))
        lens.append(row)
    return lens


def max_seq_len(phases: Phases) -> int:
    return max(
        n + r.max_tokens
        for ps, ls in zip(phases, phase_prompt_lens(phases))
        for r, n in zip(ps, ls)
    )


def total_kv_tokens(phases: Phases) -> int:
    """KV slots that hold every token of every request at once (an upper bound)."""
    return sum(
        n + r.max_tokens
        for ps, ls in zip(phases, phase_prompt_lens(phases))
        for r, n in zip(ps, ls)
    )


def ideal_prefill_tokens(phases: Phases) -> int:
    """Prompt tokens a perfect token-level prefix cache would still compute.

    Each prompt reuses its longest prefix already in KV from an *earlier phase* (requests of the
    same phase are admitted together and cannot reuse each other); a finished request leaves
    its prompt and all but its last generated token in KV; at least one token is computed.
    Generated tokens are stood in for by unique placeholders, so only the workload's structure
    counts, never an accidental match.
    """
    counter = iter(range(-1, -(1 << 62), -1))
    outputs = [[[next(counter) for _ in range(r.max_tokens)] for r in phase] for phase in phases]
    trie: dict[int, Any] = {}

    def insert(ids: list[int]) -> None:
        node = trie
        for t in ids:
            node = node.setdefault(t, {})

    def match(ids: list[int]) -> int:
        node, n = trie, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    computed = 0
    prompts = build_prompts(phases, outputs)
    for k, phase_prompts in enumerate(prompts):
        for p in phase_prompts:
            computed += len(p) - min(match(p), len(p) - 1)
        for p, out in zip(phase_prompts, outputs[k]):
            insert(p + out[:-1])
    return computed


def next_prompts(
    phase: list[Request], prev_prompts: list[list[int]], prev_outputs: list[list[int]]
) -> list[list[int]]:
    """The prompts of a phase, given the previous phase's prompts and generated tokens."""
    return [
        ([] if r.base is None else prev_prompts[r.base] + prev_outputs[r.base]) + r.ids
        for r in phase
    ]


def build_prompts(phases: Phases, outputs: list[list[list[int]]]) -> list[list[list[int]]]:
    """The actual prompt of every request, given the tokens generated in every phase."""
    prompts: list[list[list[int]]] = []
    for k, phase in enumerate(phases):
        prompts.append(next_prompts(phase, prompts[-1] if k else [], outputs[k - 1] if k else []))
    return prompts


# ---------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """One timed run of a workload on one engine."""

    engine: str
    workload: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    # Prompt tokens the engine actually ran through the model (None when unknown).
    prefill_computed: int | None = None
    # Decode phase only: steps and their time (None when not measured).
    decode_steps: int | None = None
    decode_s: float | None = None
    # Requests whose output length differed from max_tokens (should be 0).
    bad_lengths: int = 0
    # Busy-loop processes spinning beside the engine during this run (benchmark/contention.py).
    contention: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_steps_per_s(self) -> float | None:
        if not self.decode_steps or not self.decode_s:
            return None
        return self.decode_steps / self.decode_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(output_tps=self.output_tps, total_tps=self.total_tps, hit_rate=self.hit_rate)
        return data


def median_run(runs: Sequence[RunResult], upper: bool = False) -> RunResult:
    """The run with the median wall time (for an even count the lower middle one, or with
    `upper` the higher: the slower of the two)."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[len(ordered) // 2 if upper else (len(ordered) - 1) // 2]
    chosen.extra["repeats"] = len(runs)
    chosen.extra["wall_s_all"] = [round(r.wall_s, 4) for r in runs]
    if len(runs) > 1:
        chosen.extra["wall_s_stdev"] = statistics.stdev(r.wall_s for r in runs)
    return chosen


# ---------------------------------------------------------------------------- minisgl
class MinisglRunner:
    """An in-process `minisgl.llm.LLM` that counts the prompt tokens each prefill computes."""

    def __init__(
        self,
        model_path: Path,
        dtype: str,
        name: str = "minisgl",
        max_seq_len: int = 2048,
        kv_tokens: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        self.name = name
        page_size = int(llm_kwargs.get("page_size", 1))
        num_pages = None if kv_tokens is None else -(-kv_tokens // page_size)
        # Headroom over the longest request, rounded to 64: a modest KV/page-table footprint
        # that does not sit exactly on the engine's length limit.
        self.llm = LLM(
            str(model_path),
            dtype=dtype,
            max_seq_len_override=-(-(max_seq_len + 1) // 64) * 64,
            num_page_override=num_pages,
            **llm_kwargs,
        )
        # (phase, start, end, prompt tokens computed, batch size) of every forward step.
        self.events: list[tuple[str, float, float, int, int]] = []
        orig = self.llm._forward

        def spy(forward_input: Any) -> Any:
            batch = forward_input.batch
            computed = 0
            if batch.is_prefill:
                # One position per prompt token computed. Read from the prepared batch, not
                # from `extend_len`: with overlap scheduling this runs on a worker thread while
                # the scheduler already moves each request's `cached_len` on.
                positions = getattr(batch, "positions", None)
                computed = (
                    sum(r.extend_len for r in batch.reqs)
                    if positions is None
                    else int(positions.numel())
                )
            start = time.perf_counter()
            out = orig(forward_input)
            self.events.append((batch.phase, start, time.perf_counter(), computed, len(batch.reqs)))
            return out

        self.llm._forward = spy  # type: ignore[method-assign]

    def run(self, phases: Phases, workload: str = "") -> RunResult:
        """Run the phases in order; wall time is the sum of the `generate` calls."""
        self.events.clear()
        outputs: list[list[list[int]]] = []
        prompts_done: list[list[list[int]]] = []
        wall = 0.0
        prompt_tokens = output_tokens = cached = bad = 0
        for k, phase in enumerate(phases):
            prompts = next_prompts(phase, prompts_done[-1] if k else [], outputs[-1] if k else [])
            params = [
                SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                for r in phase
            ]
            start = time.perf_counter()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            wall += time.perf_counter() - start
            outputs.append([o["token_ids"] for o in outs])
            prompts_done.append(prompts)
            prompt_tokens += sum(o["prompt_tokens"] for o in outs)
            output_tokens += sum(len(o["token_ids"]) for o in outs)
            cached += sum(o["cached_tokens"] for o in outs)
            bad += sum(len(o["token_ids"]) != r.max_tokens for o, r in zip(outs, phase))
        decodes = [e for e in self.events if e[0] == "decode"]
        return RunResult(
            engine=self.name,
            workload=workload,
            wall_s=wall,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            cached_tokens=cached,
            prefill_computed=sum(e[3] for e in self.events),
            decode_steps=len(decodes) or None,
            # From the start of the first decode forward to the end of the last one: includes
            # the scheduler's work between steps, not just the model.
            decode_s=(decodes[-1][2] - decodes[0][1]) if decodes else None,
            bad_lengths=bad,
            extra={"outputs": outputs},
        )

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm
        gc.collect()


# ---------------------------------------------------------------------------- HF transformers
class HFRunner:
    """Hugging Face transformers `generate`: static batches, left padding, greedy."""

    def __init__(self, model_path: Path, dtype: str, batch_size: int | None = None) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.name = "HF transformers"
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=parse_dtype(dtype)
        ).to(self.device)
        self.model.eval()
        # The same thread count minisgl got (the minisgl engine sets it process-wide too).
        torch.set_num_threads(engine_threads())
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.batch_size = batch_size

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def run(self, phases: Phases, workload: str = "") -> RunResult:
        """Each phase in batches of `batch_size` (default: the whole phase at once).

        A batch generates max(max_tokens) for every row (HF has no per-row length in one batch);
        only the requested tokens are counted as output.
        """
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            """Never stops; records when each generation step ends."""

            def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        outputs: list[list[list[int]]] = []
        prompts_done: list[list[list[int]]] = []
        wall = decode_s = 0.0
        decode_steps = prompt_tokens = output_tokens = bad = 0
        for k, phase in enumerate(phases):
            prompts = next_prompts(phase, prompts_done[-1] if k else [], outputs[-1] if k else [])
            prompts_done.append(prompts)
            size = self.batch_size or len(phase)
            phase_out: list[list[int]] = []
            for lo in range(0, len(phase), size):
                chunk, reqs = prompts[lo : lo + size], phase[lo : lo + size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, p in enumerate(chunk):
                    ids[i, width - len(p) :] = torch.tensor(p)
                    mask[i, width - len(p) :] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                new = max(r.max_tokens for r in reqs)
                stamps.clear()
                self._sync()
                start = time.perf_counter()
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        do_sample=False,
                        max_new_tokens=new,
                        min_new_tokens=new,
                        pad_token_id=self.pad_id,
                        stopping_criteria=StoppingCriteriaList([_Stamp()]),
                    )
                self._sync()
                wall += time.perf_counter() - start
                if len(stamps) > 1:  # stamp 0 ends the prefill step
                    decode_steps += len(stamps) - 1
                    decode_s += stamps[-1] - stamps[0]
                gen = out[:, width:].tolist()
                for r, toks, p in zip(reqs, gen, chunk):
                    bad += len(toks) != new
                    phase_out.append(toks[: r.max_tokens])
                    prompt_tokens += len(p)
                    output_tokens += r.max_tokens
            outputs.append(phase_out)
        return RunResult(
            engine=self.name,
            workload=workload,
            wall_s=wall,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            prefill_computed=prompt_tokens,
            decode_steps=decode_steps or None,
            decode_s=decode_s or None,
            bad_lengths=bad,
            extra={"outputs": outputs},
        )

    def close(self) -> None:
        del self.model
        gc.collect()


# ---------------------------------------------------------------------------- vLLM peer
def vllm_python() -> Path | None:
    """The peer venv's interpreter when `scripts/setup_vllm.sh` has set it up."""
    python = PEERS_DIR / "vllm" / "bin" / "python"
    return python if python.exists() else None


def _tcmalloc() -> str | None:
    try:
        files = subprocess.run(
            ["dpkg", "-L", "libtcmalloc-minimal4"], capture_output=True, text=True, check=False
        ).stdout.split()
    except FileNotFoundError:
        return None
    return next((f for f in files if f.endswith("minimal.so.4")), None)


def vllm_env(kv_gb: float, threads: int | None = None) -> tuple[dict[str, str], list[str]]:
    """PEERS.md's best settings: OpenMP threads bound to cores, tcmalloc + Intel OpenMP preloaded.

    `threads` cores are bound (default: the in-process engines' count). Returns the environment
    and notes on what was missing.
    """
    env = dict(os.environ)
    notes = []
    cores = available_cores()[: threads or engine_threads()]
    env["VLLM_CPU_OMP_THREADS_BIND"] = (
        f"{cores[0]}-{cores[-1]}"
        if cores == list(range(cores[0], cores[-1] + 1))
        else ",".join(map(str, cores))
    )
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gb) if float(kv_gb).is_integer() else kv_gb)
    preload = []
    tcmalloc = _tcmalloc()
    if tcmalloc:
        preload.append(tcmalloc)
    else:
        notes.append("libtcmalloc-minimal4 not installed (apt-get), running without it")
    iomp = PEERS_DIR / "vllm" / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    else:
        notes.append(f"{iomp} missing, running without Intel OpenMP")
    if preload:
        env["LD_PRELOAD"] = ":".join(
            preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])
        )
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env, notes


@dataclass
class PeerRun:
    """One timed run for the peer: its name, repeat index and phases."""

    name: str
    phases: Phases
    repeat: int = 0


def run_vllm_peer(
    model_path: Path,
    dtype: str,
    runs: Sequence[PeerRun],
    warmup: Phases,
    max_model_len: int,
    enable_prefix_caching: bool,
    block_size: int | None = None,
    kv_gb: float = 4.0,
    threads: int | None = None,
    timeout_s: float = 3600.0,
    log: Callable[[str], None] = print,
    after_run: Callable[[int], None] | None = None,
) -> list[RunResult] | None:
    """Run the workloads through vLLM's CPU backend in `.peers/vllm`; None when unavailable.

    One engine serves every run (its ~60 s start-up is not timed). Run names become the
    results' workload names; repeats of a name are separate runs. `after_run(i)` is called on
    a reader thread when the peer reports that runs[i] ended; the peer does not wait for it, so
    runs[i + 1] sees its effect within the thread's wake-up (about a millisecond).
    """
    python = vllm_python()
    if python is None:
        log(
            "vLLM peer: ABSENT (no .peers/vllm venv); run scripts/setup_vllm.sh to install it. "
            "Continuing without it."
        )
        return None
    env, notes = vllm_env(kv_gb, threads)
    for note in notes:
        log(f"vLLM peer: {note}")
    spec = dict(
        model=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        block_size=block_size,
        warmup=phases_to_json(warmup),
        runs=[dict(name=r.name, repeat=r.repeat, phases=phases_to_json(r.phases)) for r in runs],
    )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log_path = OUT_DIR / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        log(
            f"vLLM peer: starting (caching={'on' if enable_prefix_caching else 'off'}, log {log_path})"
        )
        with open(log_path, "w") as log_file:
            # Its own process group: vLLM forks workers, and all of them go when we do.
            proc = subprocess.Popen(
                [str(python), str(VLLM_RUNNER), str(spec_path), str(result_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            reader = threading.Thread(
                target=_follow_peer, args=(proc, log_file, runs, after_run), daemon=True
            )
            reader.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = -1
            finally:
                stop_process_group(proc)
                reader.join(timeout=10.0)
        if rc != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            log(f"vLLM peer: FAILED (exit {rc}); last lines of {log_path}:")
            for line in tail:
                log(f"    {line}")
            return None
        result = json.loads(result_path.read_text())
    log(f"vLLM peer: vllm {result.get('vllm_version')} started in {result['startup_s']:.0f} s")
    name = "vLLM CPU" + (" +prefix cache" if enable_prefix_caching else "")
    out = []
    for run in result["runs"]:
        out.append(
            RunResult(
                engine=name,
                workload=run["name"],
                wall_s=run["wall_s"],
                prompt_tokens=run["prompt_tokens"],
                output_tokens=run["output_tokens"],
                cached_tokens=run["cached_tokens"] or 0,
                prefill_computed=(
                    None
                    if run["cached_tokens"] is None
                    else run["prompt_tokens"] - run["cached_tokens"]
                ),
                bad_lengths=run["bad_lengths"],
                extra={"repeat": run["repeat"]},
            )
        )
    return out


def _follow_peer(
    proc: subprocess.Popen[str],
    log_file: Any,
    runs: Sequence[PeerRun],
    after_run: Callable[[int], None] | None,
) -> None:
    """Copy the peer's output into its log; call `after_run(i)` on run i's progress line
    (`NAME #REPEAT: S s`, printed by vllm_offline.py as each run ends, in order)."""
    assert proc.stdout is not None
    done = 0
    for line in proc.stdout:
        log_file.write(line)
        log_file.flush()
        if done < len(runs) and line.startswith(f"{runs[done].name} #{runs[done].repeat}: "):
            if after_run is not None:
                after_run(done)
            done += 1


# ---------------------------------------------------------------------------- output
def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM a child's process group (start_new_session=True), SIGKILL it after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(timeout=wait_s)
            if sig == signal.SIGTERM:
                # The leader is gone; make sure no worker of its group lingers.
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so `finally` blocks stop peers and servers."""

    def _raise_exit(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise_exit)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into docs), columns padded for the terminal."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in text:
        lines.append("| " + " | ".join(v.rjust(w) for v, w in zip(r, widths)) + " |")
    return "\n".join(lines)


@dataclass
class Panel:
    """One bar chart: a group per workload / batch size, a bar per engine (None: no bar)."""

    groups: Sequence[str]
    series: dict[str, Sequence[float | None]]
    ylabel: str
    title: str = ""
    # One marker per group, e.g. the roofline bound.
    bounds: Sequence[float | None] | None = None
    bound_label: str = "bound"


def bar_chart(path: Path, title: str, panels: Sequence[Panel]) -> bool:
    """Grouped bar charts side by side, saved as a PNG.

    Returns False when matplotlib is missing (the table still prints).
    """
    plt = pyplot_or_none()
    if plt is None:
        return False
    width_per = max(5.0, 0.5 * max(len(p.groups) * max(1, len(p.series)) for p in panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width_per * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        x = np.arange(len(panel.groups))
        width = 0.8 / max(1, len(panel.series))
        top = 0.0
        for i, (name, values) in enumerate(panel.series.items()):
            heights = [np.nan if v is None else v for v in values]
            offset = (i - (len(panel.series) - 1) / 2) * width
            bars = ax.bar(x + offset, heights, width, label=name)
            labels = ["" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
            top = max([top] + [v for v in values if v is not None])
        for b in panel.bounds or []:
            top = max(top, b or 0.0)
        if panel.bounds is not None:
            ax.scatter(
                x,
                [np.nan if b is None else b for b in panel.bounds],
                marker="_",
                s=900,
                color="black",
                label=panel.bound_label,
                zorder=3,
            )
        ax.set_xticks(x, panel.groups, fontsize=8)
        ax.set_ylabel(panel.ylabel)
        if panel.title:
            ax.set_title(panel.title, fontsize=9)
        if top > 0:
            ax.set_ylim(0, top * 1.25)  # room for the legend above the bars
        entries = len(panel.series) + (panel.bounds is not None)
        ax.legend(fontsize=7, loc="upper center", ncol=min(entries, 4), frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def machine_note() -> str:
    """One line on where the figures come from: cores, threads, load."""
    cores = len(available_cores())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cores} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"load average {load:.2f} at start"
    )


def base_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares (--model, --dtype)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc.split("\n\n")[1:]),
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"default model when omitted; '{QWEN3_RANDOM}' (built once); or an HF folder/GGUF",
    )
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32, float16")
    return p


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options offline.py and prefix.py share: KV page size, peers, repeats, seed, threads, out."""
    p.add_argument("--page-size", type=int, default=1, help="minisgl KV page size")
    p.add_argument("--peer", action="append", default=[], choices=["vllm"], help="also run a peer")
    p.add_argument("--vllm-kv-gb", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every engine (default: one per available core)",
    )
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the PNG and JSON go")


def parse_run_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, rejecting a --repeat below 1."""
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def pyplot_or_none() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")
        return None
    return plt
