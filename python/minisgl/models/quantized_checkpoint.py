"""Quantized Hugging Face checkpoints (the folders vLLM serves: compressed-tensors, AWQ, GPTQ) seen
as the dense checkpoint they stand for, each quantized weight also repacked exactly into a
QuantizedWeight. Weight-only: activation and KV-cache quantization settings are ignored, the
model runs its activations in bf16/fp16."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl.layers.quant_weight import NIBBLE_BLOCK, QuantizedWeight, pack_nibbles

from .weight import MappedCheckpoint, TensorEntry

# compressed-tensors formats whose weights are integers this module can repack.
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# Each method's tensors behind one quantized weight (all hidden from the dense view).
_AUX = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}
# Per-module tensors the runtime never reads (activation / KV-cache quantization is ignored).
_IGNORED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
_IGNORED += ("k_scale", "v_scale", "input_global_scale", "weight_g_idx")
# AWQ GEMM puts column j of each run of 8 in nibble _AWQ_SLOT[j] of its int32.
_AWQ_SLOT = [0, 4, 1, 5, 2, 6, 3, 7]
# What a reader gives: integers [N, K] and zeros [N, G] (or one for all), both unsigned
# (0 .. 2**bits - 1), float32 scales [N, G] and the bits; the weight is scales * (ints - zeros).
_Ints = tuple[torch.Tensor, "torch.Tensor | int", torch.Tensor, int]


def quantization_method(model_dir: Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method` from config.json (None: unquantized)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = config.get("quantization_config")
    return None if quant is None else str(quant.get("quant_method", "")).lower()


@dataclass(frozen=True)
class _Source:
    """One quantized weight: its module prefix, format and dense [out, in] shape."""

    prefix: str
    kind: str  # "ct-packed", "ct-int", "awq", "gptq"
    shape: tuple[int, int]


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int16 [..., W * 32 / bits] from int32 [..., W]: value i of a word in its bits
    [i * bits, (i + 1) * bits), as every format here packs them."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.int16).flatten(-2)


def _fail(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field} = {value!r}: {why}")


class QuantizedCheckpoint:
    """A quantized checkpoint in the dense view of `MappedCheckpoint`: `entries` lists the tensors
    the unquantized model has (auxiliary quantization tensors hidden), `tensor` gives a quantized
    weight as its float32 dequantization, and `quantized` gives it as a QuantizedWeight."""

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.config: dict[str, Any] = config.get("quantization_config") or {}
        self.method = str(self.config.get("quant_method", "")).lower()
        if not self.config:
            raise ValueError(f"{model_dir}/config.json has no quantization_config")
        check = {"compressed-tensors": self._check_ct, "awq": self._check_awq}
        check["gptq"] = self._check_gptq
        if self.method not in check:
            raise _fail("quant_method", self.method, f"supported: {sorted(check)}")
        check[self.method]()
        self._mapped = MappedCheckpoint(Path(model_dir))
        self._sources: dict[str, _Source] = {}
        self.entries: dict[str, TensorEntry] = {}
        try:
            self._index()
        except BaseException:
            self._mapped.__exit__(None, None, None)
            raise

    # Validation of the config, before anything is read.

    def _check_ct(self) -> None:
        cfg = self.config
        if cfg.get("quantization_status", "compressed") != "compressed":
            why = "the weights are not stored compressed"
            raise _fail("quantization_status", cfg["quantization_status"], why)
        for field in ("sparsity_config", "transform_config"):
            if cfg.get(field):
                raise _fail(field, cfg[field], "sparse / transformed weights are not supported")
        for name, group in (cfg.get("config_groups") or {}).items():
            weights = group.get("weights")
            if weights is None:
                continue  # activation-only group: the weights are stored dense
            fmt = group.get("format") or cfg.get("format")
            if fmt not in _CT_FORMATS:
                raise _fail(f"config_groups.{name}.format", fmt, f"supported: {_CT_FORMATS}")
            field = f"config_groups.{name}.weights"
            if weights.get("type", "int") != "int":
                raise _fail(f"{field}.type", weights.get("type"), "only int weights")
            if weights.get("num_bits") not in (4, 8):
                raise _fail(f"{field}.num_bits", weights.get("num_bits"), "only 4 or 8")
            strategy = weights.get("strategy", "tensor")
            if strategy not in ("tensor", "channel", "group"):
                raise _fail(f"{field}.strategy", strategy, "only tensor, channel or group")
            if weights.get("dynamic") not in (None, False):
                raise _fail(f"{field}.dynamic", weights.get("dynamic"), "weights must be static")

    def _check_awq(self) -> None:
        if self.config.get("bits", 4) != 4:
            raise _fail("bits", self.config.get("bits"), "AWQ is read with 4 bits only")
        version = str(self.config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _fail("version", self.config.get("version"), "only AWQ's GEMM layout")

    def _check_gptq(self) -> None:
        if self.config.get("bits", 4) not in (4, 8):
            raise _fail("bits", self.config.get("bits"), "only 4 or 8")
        fmt = self.config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _fail("checkpoint_format", fmt, "only gptq (v1) or gptq_v2")

    # The dense view.

    def _index(self) -> None:
        hidden = set(_AUX[self.method]) | set(_IGNORED)
        for name, entry in self._mapped.entries.items():
            prefix, _, leaf = name.rpartition(".")
            source = self._source(prefix, leaf)
            if source is not None:
                self._sources[f"{prefix}.weight"] = source
                self.entries[f"{prefix}.weight"] = TensorEntry(entry.file, source.shape)
            elif leaf not in hidden:
                self.entries[name] = entry

    def _source(self, prefix: str, leaf: str) -> _Source | None:
        """The quantized weight whose main tensor is `prefix.leaf`, if it is one."""
        raw = self._mapped.entries
        if self.method == "compressed-tensors":
            if leaf == "weight_packed":
                shape_name = f"{prefix}.weight_shape"
                rows, cols = (int(d) for d in self._mapped.tensor(shape_name).tolist())
                self._mapped.release(shape_name)
                return _Source(prefix, "ct-packed", (rows, cols))
            if leaf == "weight" and f"{prefix}.weight_scale" in raw:
                rows, cols = raw[f"{prefix}.weight"].shape
                return _Source(prefix, "ct-int", (rows, cols))
            return None
        if leaf != "qweight":
            return None
        rows, cols = raw[f"{prefix}.qweight"].shape
        if self.method == "awq":  # [in, out / 8]
            return _Source(prefix, "awq", (cols * 8, rows))
        return _Source(prefix, "gptq", (cols, rows * 32 // self.config.get("bits", 4)))

    @property
    def quantized_names(self) -> frozenset[str]:
        """The weights `quantized` repacks (known without reading them)."""
        return frozenset(self._sources)

    def tensor(self, name: str) -> torch.Tensor:
        """The dense tensor: as stored, or a quantized weight's float32 dequantization."""
        weight = self.quantized(name)
        return self._mapped.tensor(name) if weight is None else weight.dequantize()

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The weight `name` repacked exactly into a QuantizedWeight (None: not quantized)."""
        if name not in self.entries:
            raise KeyError(name)
        source = self._sources.get(name)
        if source is None:
            return None
        read = {"ct-packed": self._ct_packed, "ct-int": self._ct_int}
        read.update(awq=self._awq, gptq=self._gptq)
        ints, zeros, scales, bits = read[source.kind](source)
        return _repack(name, ints, zeros, scales, bits)

    def release(self, name: str) -> None:
        """Let go of the pages of every stored tensor behind `name`."""
        source = self._sources.get(name)
        if source is None:
            self._mapped.release(name)
            return
        for leaf in ("weight", "weight_g_idx") + _AUX[self.method]:
            self._mapped.release(f"{source.prefix}.{leaf}")

    def __enter__(self) -> QuantizedCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._mapped.__exit__(*exc_info)

    # Readers, one per format, each giving _Ints.

    def _maybe(self, source: _Source, leaf: str) -> torch.Tensor | None:
        name = f"{source.prefix}.{leaf}"
        return self._mapped.tensor(name) if name in self._mapped.entries else None

    def _get(self, source: _Source, leaf: str) -> torch.Tensor:
        tensor = self._maybe(source, leaf)
        if tensor is None:
            raise ValueError(f"{source.prefix}: the checkpoint lacks {source.prefix}.{leaf}")
        return tensor

    def _ct_scales(self, source: _Source) -> torch.Tensor:
        scales = self._get(source, "weight_scale")
        if scales.numel() == 1:  # tensor strategy: one scale for every row
            return scales.float().reshape(1, 1).expand(source.shape[0], 1)
        return scales.float()

    def _ct_packed(self, source: _Source) -> _Ints:
        n, k = source.shape
        packed = self._get(source, "weight_packed")
        bits = {-(-k * b // 32): b for b in (8, 4)}.get(packed.shape[1])
        if bits is None:
            raise ValueError(
                f"{source.prefix}: weight_packed {tuple(packed.shape)} for {k} "
                "columns is neither 4 nor 8 bits (weights.num_bits)"
            )
        ints = _unpack(packed, bits)[:, :k]
        scales = self._ct_scales(source)
        zeros: torch.Tensor | int = 1 << (bits - 1)  # stored values are offset by half the range
        zero_point = self._maybe(source, "weight_zero_point")
        if zero_point is not None:
            if zero_point.shape[0] == n:  # not packed: signed
                zeros = zero_point.to(torch.int16) + zeros
            else:  # packed down the rows, offset like the values
                zeros = _unpack(zero_point.T.contiguous(), bits)[:, :n].T
        _check_order(self._maybe(source, "weight_g_idx"), k, scales, source.prefix)
        return ints, zeros, scales, bits

    def _ct_int(self, source: _Source) -> _Ints:
        weight = self._get(source, "weight")
        if weight.dtype != torch.int8:
            raise ValueError(f"{source.prefix}.weight: {weight.dtype} is not int8 (weights.type)")
        scales = self._ct_scales(source)
        zeros: torch.Tensor | int = 128
        zero_point = self._maybe(source, "weight_zero_point")
        if zero_point is not None:
            zeros = zero_point.to(torch.int16) + 128
        g_idx = self._maybe(source, "weight_g_idx")
        _check_order(g_idx, source.shape[1], scales, source.prefix)
        return weight.to(torch.int16) + 128, zeros, scales, 8

    def _awq(self, source: _Source) -> _Ints:
        qweight, qzeros = self._get(source, "qweight"), self._maybe(source, "qzeros")
        scales = self._get(source, "scales")

        def columns(packed: torch.Tensor) -> torch.Tensor:
            slots = _unpack(packed, 4).view(packed.shape[0], -1, 8)
            return slots[:, :, _AWQ_SLOT].flatten(1).T  # [out, rows]

        zeros = 8 if qzeros is None else columns(qzeros)
        return columns(qweight), zeros, scales.float().T, 4

    def _gptq(self, source: _Source) -> _Ints:
        bits = self.config.get("bits", 4)
        qweight, qzeros = self._get(source, "qweight"), self._get(source, "qzeros")
        scales = self._get(source, "scales").float().T
        ints = _unpack(qweight.T.contiguous(), bits)  # packed down the input columns
        zeros = _unpack(qzeros, bits).T
        if self.config.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1
        _check_order(self._maybe(source, "g_idx"), source.shape[1], scales, source.prefix)
        return ints, zeros.contiguous(), scales, bits


def _check_order(g_idx: torch.Tensor | None, cols: int, scales: torch.Tensor, name: str) -> None:
    """Refuse a g_idx that is not column // group: act-order reads columns out of order."""
    groups = torch.arange(cols) // max(cols // scales.shape[1], 1)
    if g_idx is not None and not torch.equal(g_idx.long(), groups):
        raise ValueError(
            f"{name}: act-order (GPTQ desc_act, compressed-tensors weights.actorder) with a "
            "permuting g_idx is not supported"
        )


def _narrowest(*tensors: torch.Tensor | None) -> torch.dtype:
    """float16 where every value converts to it exactly, else float32."""
    for t in tensors:
        if t is not None and not torch.equal(t.half().float(), t):
            return torch.float32
    return torch.float16


def _repack(
    name: str, ints: torch.Tensor, zeros: torch.Tensor | int, scales: torch.Tensor, bits: int
) -> QuantizedWeight:
    """QuantizedWeight for scales * (ints - zeros): the 4-bit layout where the shape allows it,
    else the 8-bit one (values shifted to signed, the shift moved into the mins)."""
    rows, cols = ints.shape
    if scales.dim() != 2 or scales.shape[0] != rows or cols % scales.shape[1]:
        raise ValueError(
            f"{name}: scales {tuple(scales.shape)} do not fit a [{rows}, {cols}] weight"
        )
    group = cols // scales.shape[1]
    if bits == 4 and cols % NIBBLE_BLOCK == 0 and group % 32 == 0:
        values = pack_nibbles(ints)
    else:
        if group % 16:
            raise ValueError(f"{name}: group of {group} columns is not a multiple of 16")
        half = 1 << (bits - 1)
        values, zeros, bits = (ints - half).to(torch.int8).contiguous(), zeros - half, 8
    # scale * zero is exact in float32 (a 16-bit-or-narrower scale times a small integer).
    if isinstance(zeros, int):
        mins = -(scales * zeros) if zeros else None
    else:
        mins = -(scales * zeros.float()) if zeros.any() else None
    dtype = _narrowest(scales, mins)
    mins = None if mins is None else mins.to(dtype).contiguous()
    return QuantizedWeight(values, scales.to(dtype).contiguous(), mins, bits, group)
