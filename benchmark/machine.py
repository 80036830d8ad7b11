"""This machine: its cores and the engines' thread count, its memory bandwidth and matmul peak,
and the roofline bounds they set for a model (`ModelCost`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
from timing import best_seconds

from minisgl.layers.linear import onednn_pack


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


def machine_note() -> str:
    """One line on where the figures come from: cores, threads, load."""
    cores = len(available_cores())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cores} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"load average {load:.2f} at start"
    )


@dataclass(frozen=True)
class Machine:
    """The two figures a roofline needs: memory read bandwidth and matmul peak (in the dtype the
    model runs in; PEERS.md's reference figures are bf16's)."""

    bandwidth_gbs: float
    matmul_tflops: float
    source: str

    def describe(self) -> str:
        """Both figures and where they come from, in one line."""
        return f"{self.bandwidth_gbs:.1f} GB/s, {self.matmul_tflops:.2f} TFLOP/s ({self.source})"


# shared/PEERS.md's machine (2-core Zen 5), on which the issues' absolute figures were set.
REFERENCE_MACHINE = Machine(35.0, 0.97, "the 2-core Zen 5 of shared/PEERS.md")


def measure_machine(dtype: torch.dtype = torch.bfloat16) -> Machine:
    """Measure this machine (about two seconds, with torch's current thread count).

    Bandwidth: a float32 sum over 1 GiB, far beyond any cache. Peak: oneDNN's matmul in `dtype`
    (a packed 2,048 x 2,048 weight, as the engine multiplies on CPU; F.linear where oneDNN cannot
    pack the dtype) on operands that fit in cache. Each is the best of several runs, since a
    bound should not be beaten.
    """
    data = torch.ones(1 << 28, dtype=torch.float32)
    bandwidth = data.numel() * 4 / best_seconds(data.sum, 5) / 1e9
    del data
    x = torch.randn(512, 2048, dtype=dtype)
    weight = torch.randn(2048, 2048, dtype=dtype)
    packed = onednn_pack(weight)

    def matmul() -> object:
        if packed is None:
            return torch.nn.functional.linear(x, weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    seconds = best_seconds(lambda: [matmul() for _ in range(4)], 5) / 4
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
