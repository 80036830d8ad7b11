"""Command-line arguments of `python -m minisgl` (server and shell)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from minisgl.kvcache import EVICTION_POLICIES
from minisgl.layers.quantized import QUANTIZATIONS

from .api_args import add_api_arguments
from .arg_types import positive_float, positive_int
from .lora_args import add_lora_arguments
from .parallel_args import add_parallel_arguments
from .speculative_args import add_speculative_arguments
from .validation import MAX_BATCH_PROMPTS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919
DEFAULT_MAX_BATCH_PROMPTS = MAX_BATCH_PROMPTS
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 10.0


@dataclass
class ServerArgs:
    """Everything the launcher needs; `model_path` None means the default model."""

    model_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    page_size: int = 1
    max_running_req: int = 256
    num_page_override: int | None = None
    max_seq_len_override: int | None = None
    cache_type: str = "radix"
    radix_eviction_policy: str = "lru"
    max_prefill_length: int | None = None
    attention_backend: str = "auto"
    # None: the engine's default (only passed on when given).
    schedule_policy: str | None = None
    overlap_schedule: bool | None = None
    log_level: str = "info"
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None
    enable_lora: bool = False
    lora_modules: list[tuple[str, str]] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    responses_max_stored: int = 1024
    responses_max_stored_mb: float = 256.0
    responses_store_dir: str | None = None
    logprobs_mode: str = "raw_logprobs"
    quantization: str | None = None
    shell: bool = False
    dp_size: int = 1
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    router_policy: str = "cache_aware"
    kv_cache_dir: str | None = None
    kv_cache_disk_gb: float = 16.0
    shell_max_tokens: int = 512
    shell_temperature: float = 0.0
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_quantization: str | None = None
    speculative_num_steps: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 6
    speculative_ngram_branch_length: int = 12
    speculative_ngram_capacity: int = 200_000

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments shared by SchedulerConfig and LLM (optional ones only if set)."""
        kwargs: dict[str, Any] = dict(
            page_size=self.page_size,
            max_running_req=self.max_running_req,
            num_page_override=self.num_page_override,
            max_seq_len_override=self.max_seq_len_override,
            cache_type=self.cache_type,
            radix_eviction_policy=self.radix_eviction_policy,
            max_prefill_length=self.max_prefill_length,
            attention_backend=self.attention_backend,
            logprobs_mode=self.logprobs_mode,
            quantization=self.quantization,
            tp_size=self.tp_size,
            kv_cache_dir=self.kv_cache_dir,
            kv_cache_disk_gb=self.kv_cache_disk_gb,
        )
        kwargs.update({k: v for k, v in asdict(self).items() if k.startswith("speculative_")})
        if self.enable_lora or self.lora_modules:
            kwargs.update(
                enable_lora=True,
                lora_modules=dict(self.lora_modules or []),
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
            )
        if self.schedule_policy is not None:
            kwargs["schedule_policy"] = self.schedule_policy
        if self.overlap_schedule is not None:
            kwargs["overlap_schedule"] = self.overlap_schedule
        return kwargs

    def model_name(self, resolved_path: Path) -> str:
        """The name clients pass as `model`: --served-model-name, else the folder's name."""
        return self.served_model_name or resolved_path.name


def build_parser() -> argparse.ArgumentParser:
    """The CLI; SGLang's and mini-sglang's spellings of our options are aliases of them."""
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model over the OpenAI HTTP API, or chat with it (--shell).",
    )
    model = p.add_argument_group("model")
    server = p.add_argument_group("server")
    kv_cache = p.add_argument_group("KV cache")
    scheduling = p.add_argument_group("scheduling")
    quantization = p.add_argument_group("quantization")
    model.add_argument(
        "--model",
        "--model-path",
        dest="model_path",
        default=None,
        help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct from its Q4_1 "
        "GGUF, served quantized; --quantization none: dense); --model-path is SGLang's spelling",
    )
    model.add_argument("--served-model-name", default=None, help="model name in the API")
    model.add_argument(
        "--dtype", default="auto", help="auto (bfloat16), float32, bfloat16 or float16"
    )
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind ({DEFAULT_HOST})")
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to serve on ({DEFAULT_PORT})"
    )
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    kv_cache.add_argument(
        "--page-size", type=int, default=1, metavar="N", help="tokens per KV page"
    )
    scheduling.add_argument(
        "--max-running-requests",
        dest="max_running_req",
        type=int,
        default=256,
        metavar="N",
        help="requests admitted at once, queued past it (default: 256)",
    )
    kv_cache.add_argument(
        "--num-pages",
        dest="num_page_override",
        type=int,
        default=None,
        metavar="N",
        help="KV pool size (default: from the memory budget)",
    )
    scheduling.add_argument(
        "--max-seq-len",
        "--max-seq-len-override",
        "--context-length",
        dest="max_seq_len_override",
        type=int,
        default=None,
        metavar="N",
        help="context length, at most the model's (default: the model's); "
        "--max-seq-len-override is mini-sglang's spelling, --context-length SGLang's",
    )
    scheduling.add_argument(
        "--max-batch-prompts",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_PROMPTS,
        metavar="N",
        help="the most sequences one request may ask for: its prompts (a /v1/completions "
        "prompt list, a /generate batch) times n, checked before any tokenization; more is a "
        f"400 (default: {DEFAULT_MAX_BATCH_PROMPTS})",
    )
    scheduling.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        metavar="S",
        help="seconds a structured-output constraint (JSON schema, regex, EBNF) may compile "
        "before its request fails with a 400, other requests unaffected; 0 or less: no limit "
        f"(default: {DEFAULT_GRAMMAR_COMPILE_TIMEOUT:g}). A compile cannot be stopped: up to 4 "
        "past the limit are left running, and while 4 are, constrained requests get a 503",
    )
    kv_cache.add_argument(
        "--cache-type",
        default="radix",
        choices=["radix", "naive"],
        help="radix: the prefix cache shares KV of common prefixes (default); naive: none",
    )
    kv_cache.add_argument(
        "--disable-radix-cache",
        dest="cache_type",
        action="store_const",
        const="naive",
        default="radix",
        help="SGLang's spelling of --cache-type naive",
    )
    kv_cache.add_argument(
        "--radix-eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES.names(),
        help="which unused cached prefix goes first when KV pages run out: lru (least recently "
        "used, default), lfu (least often used), fifo (oldest), mru (most recently used), filo "
        "(newest), priority (lowest request priority, then lru), slru (used once before used "
        "twice or more, lru within each)",
    )
    kv_cache.add_argument(
        "--kv-cache-dir",
        default=None,
        metavar="DIR",
        help="a disk KV tier in DIR: KV evicted from memory (and the whole cache at shutdown) is "
        "written there and loaded back when a prompt's prefix matches, also after a restart; "
        "keyed by model, dtype, page size and KV layout (not with --tp > 1)",
    )
    kv_cache.add_argument(
        "--kv-cache-disk-gb",
        type=positive_float,
        default=16.0,
        metavar="G",
        help="GiB the disk KV tier may hold in DIR (least recently used files go first)",
    )
    scheduling.add_argument(
        "--max-prefill-length",
        "--max-extend-length",
        "--chunked-prefill-size",
        dest="max_prefill_length",
        type=positive_int,
        default=None,
        metavar="N",
        help="prompt tokens computed per prefill step, longer prompts in chunks (default: 2048 "
        "on CPU, 8192 on CUDA); --max-extend-length is mini-sglang's spelling, "
        "--chunked-prefill-size SGLang's (its -1, no chunking, is not supported)",
    )
    scheduling.add_argument(
        "--attention-backend",
        "--attn",
        default="auto",
        help="auto, cpu or torch; --attn is mini-sglang's spelling",
    )
    scheduling.add_argument(
        "--schedule-policy",
        default=None,
        help="fcfs; lpm: longest cached prefix first; priority: highest request priority "
        "first, then arrival (default: fcfs)",
    )
    scheduling.add_argument(
        "--overlap-schedule",
        default=None,
        type=lambda s: {"on": True, "off": False}[s],
        metavar="{on,off}",
        help="overlap CPU scheduling with the forward pass (default: off on CPU, on on CUDA; "
        "MINISGL_DISABLE_OVERLAP_SCHEDULING=1 turns it off whatever this says)",
    )
    scheduling.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_const",
        const=False,
        default=None,
        help="SGLang's spelling of --overlap-schedule off",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server processes' logging (default: info)",
    )
    quantization.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weights (CPU): int8, int8-wo, int4 (-g64, -g128) quantize a dense checkpoint at "
        "load (int8 a float16 scale per 64 columns, per output row with AMX-INT8: batches of "
        "more than 5 rows meet it with their activations rounded to int8, W8A8, per 32 columns "
        "with AVX-512 VNNI (smoothed per channel as SmoothQuant, calibrated by a short "
        "prefill at start), per row on AMX-INT8's tiles; int8-wo the same weights, activations "
        "kept to 16 bits; int4 a scale and offset per 32 columns, or per 64/128, weight-only); "
        "gguf serves a GGUF file's quantized tensors as they are (the default for a .gguf model "
        "path and the default model); none loads every weight dense",
    )
    server.add_argument(
        "--shell",
        "--shell-mode",
        action="store_true",
        help="interactive chat in this terminal; --shell-mode is mini-sglang's spelling",
    )
    server.add_argument(
        "--shell-max-tokens", type=int, default=512, help="--shell: tokens per answer (512)"
    )
    server.add_argument(
        "--shell-temperature", type=float, default=0.0, help="--shell: temperature (0: greedy)"
    )
    add_parallel_arguments(p)
    add_api_arguments(p)
    add_speculative_arguments(p)
    add_lora_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse the command line into `ServerArgs`."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    names = [name for name, _ in ns.lora_modules or []]
    if len(set(names)) != len(names):
        parser.error(f"--lora-modules: each adapter name once, got {names}")
    names = {f.name for f in fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
