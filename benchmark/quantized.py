"""Weight formats side by side, one invocation: minisgl decode at batch 1/8/64, a 512-token
prompt's prefill and W1 per format
(bf16, int8 and int4 quantized at load, for a GGUF model its own quantized tensors, and with
gguf-q8_0 the model converted to a Q8_0 GGUF by llama.cpp's converter), the
weight bytes each step streams with the bandwidth bound they give, the ratio against bf16 in
the same run, and llama.cpp on the same GGUF file (--peer llamacpp; scripts/setup_llamacpp.sh
builds it) at batch 1 and in prompt processing (llama-bench's pp512 beside our pp512: the prompt
and its one token per second, a whole request's time).

    python benchmark/quantized.py                        # the default model: bf16/int8/int4/gguf
    python benchmark/quantized.py --model qwen3-0.6b-random --formats bf16,int8,int4
    python benchmark/quantized.py --peer llamacpp --batch-sizes 1 --workloads none
    python benchmark/quantized.py --peer llamacpp --formats bf16,gguf,gguf-q8_0 --workloads none

Figures only: nothing is asserted. Decode tok/s counts the decode steps alone (16-token
prompts, 128 new tokens each).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paths  # noqa: E402, F401  (before minisgl: a checkout without `pip install -e .`)
import torch  # noqa: E402
from machine import measure_machine, set_threads  # noqa: E402
from models import model_label, resolve_bench_model  # noqa: E402
from offline_runs import medians, timed_runs  # noqa: E402
from runners.minisgl import MinisglRunner  # noqa: E402
from workloads import OFFLINE_PRESETS, Shape, TokenSource, decode_shapes  # noqa: E402

from minisgl.layers.moe import SparseMoE  # noqa: E402
from minisgl.utils.hf import cache_dir, default_gguf_path  # noqa: E402


def weight_bytes(runner: MinisglRunner) -> int:
    """Bytes of every weight the model holds (quantized ones as stored, packed copies too)."""
    model = runner.llm.engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, SparseMoE):  # quantized or packed experts (dense: parameters)
            total += sum(stack.nbytes for stack in module.expert_stacks.values())
        projection = getattr(module, "cpu_projection", None)
        if projection is None or id(projection) in seen:
            continue
        seen.add(id(projection))
        total += projection.nbytes
    return total


def q8_0_gguf(model: Path) -> Path:
    """The model's HF folder as a Q8_0 GGUF, converted once by llama.cpp's converter."""
    from runners.llamacpp import converted_gguf

    return converted_gguf(model, "q8_0", cache_dir() / "bench-models" / f"{model.name}.Q8_0.gguf")


def format_kwargs(fmt: str, model: Path, gguf: Path | None) -> tuple[Path, dict]:
    """The model path and LLM keywords of a weight format."""
    if fmt == "gguf":
        if gguf is None:
            raise SystemExit("--formats gguf needs a GGUF model (the default model, or --gguf)")
        return gguf, {"quantization": "gguf"}
    if fmt == "gguf-q8_0":
        return q8_0_gguf(model), {"quantization": "gguf"}
    if fmt == "bf16":
        return model, {}
    return model, {"quantization": fmt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default, qwen3-0.6b-random, a folder or GGUF")
    p.add_argument("--gguf", default=None, help="the GGUF of --model (default model: its own)")
    p.add_argument(
        "--formats", default=None, help="bf16,int8,int4[,int8-wo][,int4-g32][,gguf][,gguf-q8_0]"
    )
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--workloads", default="W1", help="comma list of W1/W2, or none")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--peer", choices=["llamacpp"], default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=512,
        help="a prompt of this many tokens, prefill tok/s (llama.cpp: its pp test); 0: none",
    )
    args = p.parse_args()
    set_threads(args.threads)
    model = resolve_bench_model(args.model)
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None and args.model in (None, "default"):
        gguf = default_gguf_path()
    formats = (args.formats or ("bf16,int8,int4,gguf" if gguf else "bf16,int8,int4")).split(",")
    if args.peer == "llamacpp":  # before the minutes of minisgl runs, not after them
        if gguf is None and "gguf-q8_0" not in formats:
            raise SystemExit(
                "--peer llamacpp runs on a GGUF: the default model, --gguf or gguf-q8_0"
            )
        from runners.llamacpp import require_llama_bench

        require_llama_bench()
    shapes: list[Shape] = decode_shapes([int(b) for b in args.batch_sizes.split(",")], False)
    if args.prefill_tokens > 0:
        length = (args.prefill_tokens, args.prefill_tokens)
        shapes.append(Shape(f"pp{args.prefill_tokens}", 1, length, (1, 1)))
    if args.workloads != "none":
        shapes += [OFFLINE_PRESETS[w] for w in args.workloads.split(",")]
    tokens = TokenSource(model, args.seed)
    machine = measure_machine(torch.bfloat16)
    run_args = argparse.Namespace(repeat=args.repeat, contention=0, full_warmup=False)
    print(f"# {model_label(model)}, {torch.get_num_threads()} threads, {machine.describe()}")
    rows, served_ggufs = [], []
    for fmt in formats:
        path, kwargs = format_kwargs(fmt, model, gguf)
        if kwargs.get("quantization") == "gguf":
            served_ggufs.append(path)
        runner = MinisglRunner(path, "bfloat16", name=f"minisgl {fmt}", max_seq_len=1024, **kwargs)
        try:
            nbytes = weight_bytes(runner)
            per_shape = timed_runs(runner, shapes, tokens, run_args)
        finally:
            runner.close()
        figures = {}
        for shape, runs in zip(shapes, per_shape):
            run = medians(runs)[0]
            if shape.name.startswith("batch"):
                steps = run.decode_steps or 0
                figures[shape.name] = steps * shape.num_prompts / (run.decode_s or float("inf"))
            elif shape.name.startswith("pp"):  # the prompt, and its one token, per second
                figures[shape.name] = shape.input_range[0] / run.wall_s
            else:
                figures[shape.name] = run.wall_s
        rows.append((fmt, nbytes, figures))
    if args.peer == "llamacpp":  # on every GGUF the run served
        from runners.llamacpp import decode_tokens_per_s, prefill_tokens_per_s

        threads = torch.get_num_threads()
        for path in served_ggufs:
            figures = {"batch 1": decode_tokens_per_s(path, threads)}
            if args.prefill_tokens > 0:
                pp = prefill_tokens_per_s(path, threads, args.prefill_tokens)
                figures[f"pp{args.prefill_tokens}"] = pp
            rows.append((f"llama.cpp {path.name}", path.stat().st_size, figures))
    report(rows, shapes, machine.bandwidth_gbs)


def is_rate(shape: Shape) -> bool:
    """Decode batches and prefill are tokens per second (higher is better); workloads seconds."""
    return shape.name.startswith(("batch", "pp"))


def report(rows: list, shapes: list[Shape], bandwidth_gbs: float) -> None:
    """The Markdown table: decode tok/s and workload seconds, each with its ratio to bf16."""
    base = next((figures for fmt, _, figures in rows if fmt == "bf16"), None)
    header = "| format | weights MB | bound steps/s |"
    for shape in shapes:
        unit = "tok/s" if is_rate(shape) else "s"
        header += f" {shape.name} {unit} | vs bf16 |"
    print(header)
    print("|" + "---|" * (3 + 2 * len(shapes)))
    for fmt, nbytes, figures in rows:
        cells = [fmt, f"{nbytes / 1e6:.0f}", f"{bandwidth_gbs * 1e9 / nbytes:.0f}"]
        for shape in shapes:
            value = figures.get(shape.name)
            if value is None:
                cells += ["", ""]
                continue
            rate = is_rate(shape)
            cells.append(f"{value:.0f}" if rate else f"{value:.2f}")
            ref = None if base is None else base.get(shape.name)
            ratio = "" if not ref else f"{value / ref:.2f}x" if rate else f"{ref / value:.2f}x"
            cells.append(ratio)
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
