"""Token embedding and the output head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import TensorParallel
from minisgl.kernel.cpu import CpuKernels

from .linear import (
    CPU_PROJECTION_DTYPES,
    CpuProjection,
    computes_in_float32,
    onednn_packing_available,
    tile_copy_elems,
)
from .quant_weight import QuantizedWeight
from .quantized import QuantizedProjection, quantize_head


class VocabEmbedding(nn.Module):
    """Token ids to rows of the weight; where a tied output head's packed or quantized copy is
    the weight's only copy, the rows are read from it (`read_rows_from`). tp: vocabulary-parallel,
    this rank holding rows [start, end): other ids look up zeros, summed over the group."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.sharded else None
        self.start, self.end = (
            (0, vocab_size) if self.tp is None else self.tp.vocab_rows(vocab_size)
        )
        # Rows this rank holds: what lookups and a tied head's copy index.
        self.vocab_size, self.hidden_size = self.end - self.start, hidden_size
        self.weight = nn.Parameter(torch.empty(self.vocab_size, hidden_size), requires_grad=False)
        self.rows_from: CpuProjection | QuantizedProjection | None = None
        self.dtype = torch.float32  # of the rows read from a quantized copy

    def read_rows_from(
        self, projection: CpuProjection | QuantizedProjection, dtype: torch.dtype
    ) -> None:
        """Look rows up in `projection`'s tile or quantized copy of this weight (rows in
        `dtype`), which replaces the weight."""
        if isinstance(projection, CpuProjection) and (
            projection.kernels is None or projection.tiles is None
        ):
            raise ValueError("read_rows_from needs a projection holding a tile-layout copy")
        self.rows_from, self.dtype = projection, dtype
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def prepare_for_cpu(
        self,
        kernels: CpuKernels | None,
        tiles_out: torch.Tensor | None = None,
        weight: torch.Tensor | QuantizedWeight | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Take a quantized weight handed over by the loader (rows dequantized per lookup)."""
        del tiles_out
        if isinstance(weight, QuantizedWeight):
            self.read_rows_from(QuantizedProjection(weight, kernels), dtype)
        elif weight is not None:
            self.weight = nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.vocab_size)
        rows = self._lookup(torch.where(inside, local, 0).to(input_ids.dtype))
        return self.tp.all_reduce(rows.masked_fill(~inside[..., None], 0))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        source = self.rows_from
        if source is None:
            return F.embedding(input_ids, self.weight)
        if isinstance(source, QuantizedProjection):
            rows = source.rows(input_ids.reshape(-1), self.dtype)
            return rows.view(*input_ids.shape, self.hidden_size)
        assert source.kernels is not None and source.tiles is not None
        rows = source.kernels.packed_rows(
            source.tiles, input_ids.reshape(-1), self.vocab_size, self.hidden_size
        )
        return rows.view(*input_ids.shape, self.hidden_size)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding weight when tied.
    tp: vocabulary-parallel, each rank's slice of the logits gathered to rank 0 in order."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied: VocabEmbedding | None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tied, self.vocab_size = tied, vocab_size
        self.tp = tp if tp is not None and tp.sharded else None
        if tied is None:
            start, end = (0, vocab_size) if self.tp is None else self.tp.vocab_rows(vocab_size)
            self.weight = nn.Parameter(torch.empty(end - start, hidden_size), requires_grad=False)
        self.cpu_projection: CpuProjection | QuantizedProjection | None = None
        # Set before loading: quantize the weight for this method (quantized.quantize_head).
        self.quantization: str | None = None
        # A tied float32 head without the C kernels: oneDNN reads the embedding's weight as it
        # lies (Qwen3-0.6B's head at 8 rows: 76 ms, 62 on a packed copy of its own, F.linear 170).
        self._onednn_on_weight = False
        self._logits_buffer: torch.Tensor | None = None

    def _weight(self) -> torch.Tensor:
        return self.tied.weight if self.tied is not None else self.weight

    def prepare_for_cpu(
        self,
        kernels: CpuKernels | None,
        tiles_out: torch.Tensor | None = None,
        weight: torch.Tensor | QuantizedWeight | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Pick the CPU matmul path (see layers.linear), holding the weight once: untied, a
        packed or quantized copy replaces the weight; tied, the C kernels' tile copy (into
        `tiles_out` where given) or the quantized copy replaces the embedding's weight too (its
        lookups read the copy, rows in `dtype`), and other paths multiply the embedding's
        weight itself. weight: the loaded weight where the parameter does not hold it (e.g. is
        on the meta device), quantized where the checkpoint held it so. Where the C matmuls
        compute the head, logits come out float32."""
        handed_over = weight is not None
        weight = self._weight().data if weight is None else weight
        if isinstance(weight, torch.Tensor) and self.quantization is not None:
            weight = quantize_head(weight, self.quantization) or weight
        if isinstance(weight, QuantizedWeight):
            self.cpu_projection = QuantizedProjection(weight, kernels, float_out=True)
            if self.tied is not None:
                self.tied.read_rows_from(self.cpu_projection, dtype)
            else:
                self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            return
        if weight.device.type != "cpu" or weight.dtype not in CPU_PROJECTION_DTYPES:
            return
        if self.tied is None:
            self.cpu_projection = CpuProjection(
                weight, kernels, float_out=True, tiles_out=tiles_out
            )
            if not self.cpu_projection.needs_weight:
                self.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
            elif handed_over:
                self.weight = nn.Parameter(weight.clone(), requires_grad=False)
            return
        if tile_copy_elems(*weight.shape, weight.dtype, kernels) is None:
            # oneDNN's packed copy would sit beside the rows the lookups need; where bf16/fp16
            # is multiplied in float32 it does (F.linear on them: ~7x slower, computes_in_float32).
            if handed_over:
                self.tied.weight = nn.Parameter(weight.clone(), requires_grad=False)
            if computes_in_float32(weight.dtype, kernels):
                self.cpu_projection = CpuProjection(weight, kernels, float_out=True)
            self._onednn_on_weight = weight.dtype == torch.float32 and onednn_packing_available()
            return
        self.cpu_projection = CpuProjection(weight, kernels, float_out=True, tiles_out=tiles_out)
        self.tied.read_rows_from(self.cpu_projection, weight.dtype)

    def forward(self, hidden: torch.Tensor, reuse_output: bool = False) -> torch.Tensor:
        """Logits [rows, vocab]. reuse_output: on the C matmul's path they are written into a
        buffer the next such call overwrites, as a CUDA graph's outputs are. glibc maps every
        block over 32 MB afresh, so e.g. Qwen3's 64 x 151,936 float32 logits page-faulted
        10 ms of a 23 ms head each decode step."""
        if self.tp is not None:  # gathered into a new tensor: no buffer to reuse
            return self.tp.gather_vocab(self._local_logits(hidden, False), self.vocab_size)
        return self._local_logits(hidden, reuse_output)

    def _local_logits(self, hidden: torch.Tensor, reuse_output: bool) -> torch.Tensor:
        if self.cpu_projection is None:
            if self._onednn_on_weight:
                return torch.ops.mkldnn._linear_pointwise(
                    hidden.contiguous(), self._weight(), None, "none", [], ""
                )
            return F.linear(hidden, self._weight())
        out = None
        if reuse_output and self.cpu_projection.float_out and hidden.dim() == 2:
            rows, vocab = hidden.shape[0], self.cpu_projection.out_features
            if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, vocab, dtype=torch.float32)
            out = self._logits_buffer[:rows]
        return self.cpu_projection(hidden, self._weight(), None, out)
