"""Device dispatch in one place: `ops_for(x)` is the implementation of the engine's small ops
(residual + RMSNorm, SiLU-and-mul, rotary, argmax and the sampler's draws) for x's device and
dtype, from a registry, so layers and the sampler call one interface and never test for a
kernel library. `TorchOps` is every op in PyTorch; `CpuKernelOps` runs the C kernels where they
take the shape and computes the same thing (tests/test_cpu_kernels.py holds them equal)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.kernel.abi import MAX_INTERMEDIATE, MAX_NORM_HIDDEN
from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.utils.registry import Registry


class TorchOps:
    """Every op in plain PyTorch, on any device and dtype: the reference the kernels equal."""

    kernels: CpuKernels | None = None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), normalised in float32 and scaled in x's dtype
        as transformers does; with no residual, x itself is the residual."""
        if residual is not None:
            x = residual + x
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype), x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [..., gate | up]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inputs(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> RotaryInputs:
        """The batch's rows of the rotary tables cos/sin [max_positions, dim], in dtype."""
        rows_cos = cos.index_select(0, positions).to(dtype).unsqueeze(1)
        rows_sin = sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return RotaryInputs(positions, self, rows_cos, rows_sin)

    def rotate(
        self, inputs: RotaryInputs, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """RoPE (neox layout: rotate halves) on x [tokens, heads, dim]; may rotate in place."""
        assert inputs.cos is not None and inputs.sin is not None
        return rotate_halves(x, inputs.cos, inputs.sin)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax (first index on ties); `max` is ~2.5x faster than `argmax` on CPU."""
        return x.max(dim=-1).indices

    def tempered_softmax(
        self, logits: torch.Tensor, temperatures: torch.Tensor, normalize: bool, out: torch.Tensor
    ) -> torch.Tensor:
        """out = softmax(logits / temperatures) by rows (temperatures [rows, 1]), unnormalised
        (the largest 1) unless `normalize`."""
        probs = torch.div(logits, temperatures, out=out)
        probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
        if normalize:
            probs.div_(probs.sum(dim=-1, keepdim=True))
        return probs

    def mask_disallowed(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        """Set to -inf, in place, every logit of logits[rows] whose bit in bitmask (int32
        [rows, ceil(vocab / 32)], bit j of word w: token 32 w + j) is clear."""
        rows, bitmask = rows.to(logits.device), bitmask.to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]
        logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))

    def flag_non_finite(
        self, logits: torch.Tensor, sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens with -1 where the row's chosen logit is NaN or infinite, or the token is not
        a column, tokens safe to feed back as input: 0 there), reading only each row's chosen
        logit."""
        vocab = logits.shape[-1]
        safe = sampled.clamp(0, vocab - 1)
        chosen = logits.gather(1, safe.long()[:, None])[:, 0]
        ok = torch.isfinite(chosen) & (sampled == safe)
        return torch.where(ok, sampled, -1), torch.where(ok, safe, 0)

    def top_candidates(self, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest of each row of probs, largest first, and their columns."""
        return probs.topk(k, dim=-1)

    def sample_rows(self, weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """A draw from each row of weights [B, vocab] (float32, >= 0): the first column whose
        running sum exceeds uniforms [B] times the row's total."""
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
        # At the very top (rounding) the search runs past the end: the last nonzero column.
        last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
        return torch.minimum(tokens, last)

    def sample_tempered(
        self, logits: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor
    ) -> torch.Tensor | None:
        """`sample_rows` of softmax(logits / temperature) computed while reading the logits,
        where these ops fuse it; None: the caller builds the probabilities itself."""
        return None


@dataclass
class RotaryInputs:
    """One forward's positions, looked up once for every layer, and the ops that rotate by them;
    cos and sin: their [tokens, 1, dim] rows where the ops rotate from gathered rows (None: the
    ops index the tables)."""

    positions: torch.Tensor
    ops: TorchOps
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CpuKernelOps(TorchOps):
    """The C kernels (float32 and bfloat16 on the CPU) where they take the shape, else PyTorch."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] > MAX_NORM_HIDDEN or weight.dtype != x.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        res_rows = None if residual is None else residual.reshape(rows.shape).contiguous()
        out, new_residual = self.kernels.add_rms_norm(rows, res_rows, weight, eps)
        return out.view(shape), new_residual.view(shape)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.shape[1] // 2 > MAX_INTERMEDIATE:
            return super().silu_and_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up.contiguous())

    def rotary_inputs(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> RotaryInputs:
        return RotaryInputs(positions.long().contiguous(), self)

    def rotate(
        self, inputs: RotaryInputs, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        self.kernels.rotary_(x, inputs.positions, cos, sin)
        return x

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        # ~4x faster than `max` on bf16 logits.
        if x.dim() != 2 or x.shape[1] == 0:
            return super().argmax(x)
        return self.kernels.argmax(x)

    def tempered_softmax(
        self, logits: torch.Tensor, temperatures: torch.Tensor, normalize: bool, out: torch.Tensor
    ) -> torch.Tensor:
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0:
            return super().tempered_softmax(logits, temperatures, normalize, out)
        return self.kernels.tempered_softmax(logits, temperatures[:, 0], normalize, out)

    def mask_disallowed(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        wide_enough = 32 * bitmask.shape[-1] >= logits.shape[-1]
        if logits.dim() != 2 or not logits.is_contiguous() or not wide_enough:
            return super().mask_disallowed(logits, rows, bitmask)
        self.kernels.mask_disallowed(logits, rows, bitmask)

    def flag_non_finite(
        self, logits: torch.Tensor, sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dim() != 2 or sampled.dtype != torch.int32 or sampled.dim() != 1:
            return super().flag_non_finite(logits, sampled)
        return self.kernels.flag_non_finite(logits, sampled)

    def top_candidates(self, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if probs.dtype != torch.float32:
            return super().top_candidates(probs, k)
        return self.kernels.top_candidates(probs, k)

    def sample_rows(self, weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return self.kernels.sample_rows(weights, uniforms)

    def sample_tempered(
        self, logits: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor
    ) -> torch.Tensor | None:
        return self.kernels.sample_rows(logits, uniforms, temperatures)


TORCH_OPS = TorchOps()
# Per device type: the ops for a dtype there (None: that device has no ops of its own for it).
OPS_BY_DEVICE: Registry[Callable[[torch.dtype], TorchOps | None]] = Registry("ops device")


@OPS_BY_DEVICE.register("cpu")
def _cpu_ops(dtype: torch.dtype) -> TorchOps | None:
    kernels = cpu_kernels()
    return None if kernels is None or not kernels.supports(dtype) else _kernel_ops(kernels)


@functools.cache
def _kernel_ops(kernels: CpuKernels) -> CpuKernelOps:
    return CpuKernelOps(kernels)


def ops_on(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The ops for tensors of this dtype on this device: the device's own, else PyTorch's."""
    if device.type in OPS_BY_DEVICE:
        ops = OPS_BY_DEVICE[device.type](dtype)
        if ops is not None:
            return ops
    return TORCH_OPS


def ops_for(x: torch.Tensor) -> TorchOps:
    """The ops for x's device and dtype."""
    return ops_on(x.device, x.dtype)
