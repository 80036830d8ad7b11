"""The sampling kernels' wrappers (csrc/sampling.c): greedy argmax, one draw per row from weights
or tempered logits, and the top-k candidates of each row."""

from __future__ import annotations

import torch

from minisgl.kernel.abi import DTYPE_CODES, ERR_SHAPE, check_status, require
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads


class SamplingKernels(KernelLibrary):
    """Token choice straight from the logits: argmax, draws, top candidates."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of x [rows, cols] float32 or bf16 (first index on ties, a NaN wins),
        int64."""
        x = x.contiguous()
        require(x.shape[1] > 0, "argmax: rows of 0 columns have no argmax")
        indices = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.minisgl_argmax(
            x.data_ptr(),
            indices.data_ptr(),
            x.shape[0],
            x.shape[1],
            DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        return indices

    def tempered_softmax(
        self, x: torch.Tensor, temperatures: torch.Tensor, normalize: bool, out: torch.Tensor
    ) -> torch.Tensor:
        """out = softmax(x / temperatures[:, None]) by rows (unnormalised, the largest 1, unless
        `normalize`; 0 below e^-87): x, out [rows, cols] float32, temperatures [rows] (> 0)."""
        x = x.contiguous()
        rows, cols = x.shape
        temperatures = temperatures.to(torch.float32).contiguous()
        if not (
            x.dtype == out.dtype == torch.float32
            and out.shape == x.shape
            and out.is_contiguous()
            and temperatures.shape == (rows,)
            and cols > 0
        ):
            raise ValueError(
                f"tempered_softmax: x {x.dtype} {tuple(x.shape)}, out {out.dtype} "
                f"{tuple(out.shape)}, temperatures {tuple(temperatures.shape)}"
            )
        self.lib.minisgl_tempered_softmax(
            x.data_ptr(),
            temperatures.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            int(normalize),
            kernel_threads(),
        )
        return out

    def mask_disallowed(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        """In place: every logit of logits[rows] (float32 or bf16 [*, cols], contiguous) whose
        bit in bitmask (int32 [len(rows), words], words * 32 >= cols) is clear, -inf."""
        rows, bitmask = rows.to(torch.int64).contiguous(), bitmask.contiguous()
        if not (
            logits.dim() == 2
            and logits.is_contiguous()
            and bitmask.dtype == torch.int32
            and bitmask.shape[0] == rows.shape[0]
        ):
            raise ValueError(
                f"mask_disallowed: logits {tuple(logits.shape)}, rows {tuple(rows.shape)}, "
                f"bitmask {bitmask.dtype} {tuple(bitmask.shape)}"
            )
        status = self.lib.minisgl_mask_disallowed(
            logits.data_ptr(),
            logits.shape[0],
            rows.data_ptr(),
            bitmask.data_ptr(),
            rows.shape[0],
            logits.shape[1],
            bitmask.shape[-1],
            DTYPE_CODES[logits.dtype],
            kernel_threads(),
        )
        if status == ERR_SHAPE:  # (checked in C: no per-step ops for it)
            raise ValueError(
                f"mask_disallowed: rows {rows.tolist()[:16]} of {logits.shape[0]} logit rows, a "
                f"bitmask of {bitmask.shape[-1]} words for {logits.shape[1]} columns"
            )
        check_status("mask_disallowed", status)

    def flag_non_finite(
        self, logits: torch.Tensor, sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled with -1 where a row's chosen logit is not finite or the token not one of
        its columns, sampled with 0 there): logits [rows, cols] float32 or bf16, sampled int32
        [rows]."""
        logits, sampled = logits.contiguous(), sampled.contiguous()
        rows, cols = logits.shape
        if sampled.dtype != torch.int32 or sampled.shape != (rows,):
            raise ValueError(
                f"flag_non_finite: sampled {sampled.dtype} {tuple(sampled.shape)} for {rows} rows"
            )
        next_tokens, pool_tokens = torch.empty_like(sampled), torch.empty_like(sampled)
        self.lib.minisgl_flag_non_finite(
            logits.data_ptr(),
            sampled.data_ptr(),
            next_tokens.data_ptr(),
            pool_tokens.data_ptr(),
            rows,
            cols,
            DTYPE_CODES[logits.dtype],
        )
        return next_tokens, pool_tokens

    def sample_rows(
        self,
        weights: torch.Tensor,
        uniforms: torch.Tensor,
        temperatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A draw from each row of weights [rows, cols] (float32, >= 0, not all zero): the first
        column whose running sum exceeds uniforms [rows] (float64 in [0, 1)) times the row's
        total. Given temperatures [rows] (float32, > 0), the rows are logits and the weights
        softmax(row / temperature), computed on the fly. int64 [rows]."""
        weights, uniforms = weights.contiguous(), uniforms.contiguous()
        assert weights.dtype == torch.float32 and uniforms.dtype == torch.float64
        rows, cols = weights.shape
        require(cols > 0, "sample_rows: rows of 0 columns have nothing to draw")
        if not (
            uniforms.shape == (rows,) and (temperatures is None or temperatures.shape == (rows,))
        ):
            raise ValueError(
                f"sample_rows: uniforms {tuple(uniforms.shape)} / temperatures for {rows} rows"
            )
        if temperatures is not None:
            temperatures = temperatures.to(torch.float32).contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        self.lib.minisgl_sample_rows(
            weights.data_ptr(),
            None if temperatures is None else temperatures.data_ptr(),
            uniforms.data_ptr(),
            tokens.data_ptr(),
            rows,
            cols,
            kernel_threads(),
        )
        return tokens

    def top_candidates(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest values of each row of x [rows, cols] (float32, k <= cols), largest
        first (the first column first among equals), and their columns (int64)."""
        x = x.contiguous()
        assert x.dtype == torch.float32
        require(0 < k <= x.shape[1], f"top_candidates: k {k} is outside 1..{x.shape[1]}")
        values = torch.empty(x.shape[0], k, dtype=torch.float32)
        indices = torch.empty(x.shape[0], k, dtype=torch.int64)
        status = self.lib.minisgl_top_candidates(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            k,
            values.data_ptr(),
            indices.data_ptr(),
            kernel_threads(),
        )
        check_status("top_candidates", status)
        return values, indices
