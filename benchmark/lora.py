"""Multi-LoRA: decode tokens/s of one batch of requests spread over several adapters against
the same batch on the base model, in one invocation.

Adapters are random PEFT folders (rank `--rank`, every q/k/v/o and gate/up/down projection)
written for the model's shapes. Runs, each prefilled into the radix cache first so the timed
part is decode: the base model on an engine without LoRA (the fused decode layer where the CPU
has it), the base model on the LoRA engine, and the batch over `--adapters` adapters.
Figures only: nothing is asserted.

    python benchmark/lora.py                      # default model, 16 requests over 4 adapters
    python benchmark/lora.py --batch 16 --adapters 4 --rank 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paths  # noqa: E402,F401  (before minisgl: a checkout without `pip install -e .`)
import torch  # noqa: E402
from machine import machine_note, set_threads  # noqa: E402
from models import model_label, model_source  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.models import load_model_config  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model_dir: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for the model at `model_dir` (rank, alpha = 2 * rank)."""
    config = load_model_config(model_dir)
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_qo_heads * head, config.num_kv_heads * head
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * 0.01
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(adapter))


def decode_rate(llm: LLM, ids: list[list[int]], max_tokens: int, loras: list[str | None]) -> float:
    """Output tokens / second of one greedy generate whose prompts are cached."""
    llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False, lora=loras)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(ids, params, use_tqdm=False, lora=loras)
    return sum(len(o["token_ids"]) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or name (default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    model = model_source(args.model)
    plain = LLM(model, dtype=args.dtype, max_running_req=args.batch)
    with tempfile.TemporaryDirectory(prefix="minisgl-lora-") as tmp:
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, plain.model_path, args.rank, seed=i)
        lora = LLM(
            model,
            dtype=args.dtype,
            max_running_req=args.batch,
            lora_modules={name: Path(tmp) / name for name in names},
            max_loras=args.adapters,
            max_lora_rank=args.rank,
        )
    words = "one two three four five six seven eight nine ten".split()
    prompts = [f"Count on from {words[i % 10]} in words, {i}:" for i in range(args.batch)]
    ids = [plain.tokenizer(p).input_ids for p in prompts]
    spread = [names[i % args.adapters] for i in range(args.batch)]
    base_only: list[str | None] = [None] * args.batch
    for llm in (plain, lora):  # warm-up
        llm.generate(ids[:2], SamplingParams(max_tokens=8), use_tqdm=False)
    rates = {
        "base, engine without LoRA": decode_rate(plain, ids, args.max_tokens, base_only),
        "base, LoRA engine": decode_rate(lora, ids, args.max_tokens, base_only),
        f"{args.adapters} adapters": decode_rate(lora, ids, args.max_tokens, spread),
    }
    label = model_label(plain.model_path) + (" (GGUF)" if plain.config.gguf_path else "")
    print(
        f"# multi-LoRA: {label}, {plain.config.quantization or args.dtype}, batch {args.batch}, "
        f"rank {args.rank}, {args.max_tokens} new tokens; {machine_note()}"
    )
    print("| run | decode tok/s | vs base without LoRA |")
    print("|---|---|---|")
    first = next(iter(rates.values()))
    for run, rate in rates.items():
        print(f"| {run} | {rate:.1f} | {rate / first:.2f}x |")
    plain.shutdown()
    lora.shutdown()


if __name__ == "__main__":
    main()
