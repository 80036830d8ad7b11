"""Which checkpoint a model loads from: a safetensors folder as it is, a GGUF file's quantized
tensors, or a quantized folder's (compressed-tensors), by the quantization asked for."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch

from minisgl.layers.quant_weight import QuantizedWeight

from .weight import Checkpoint, MappedCheckpoint, TensorEntry


class DenseView:
    """A quantized checkpoint seen with every tensor dense (its dequantization)."""

    def __init__(self, checkpoint: AbstractContextManager[Checkpoint]) -> None:
        self._context = checkpoint
        self._checkpoint: Checkpoint | None = None

    def __enter__(self) -> DenseView:
        self._checkpoint = self._context.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._context.__exit__(*exc_info)

    @property
    def entries(self) -> dict[str, TensorEntry]:
        assert self._checkpoint is not None
        return self._checkpoint.entries

    @property
    def quantized_names(self) -> frozenset[str]:
        return frozenset()

    def tensor(self, name: str) -> torch.Tensor:
        assert self._checkpoint is not None
        return self._checkpoint.tensor(name)

    def quantized(self, name: str) -> QuantizedWeight | None:
        del name
        return None

    def release(self, name: str) -> None:
        assert self._checkpoint is not None
        self._checkpoint.release(name)


def open_checkpoint(
    model_dir: Path, quantization: str | None, gguf_path: str | Path | None
) -> AbstractContextManager[Checkpoint]:
    """The checkpoint to load (a context manager). "gguf": `gguf_path`'s tensors, quantized
    ones kept so; any other with a `gguf_path`: its tensors dense (its folder holds only the
    config and tokenizer); "none": the folder's tensors, dense (dequantized where stored
    quantized); otherwise the folder's, a quantized folder's weights kept quantized."""
    if quantization == "gguf" and gguf_path is None:
        raise ValueError("quantization='gguf' needs a .gguf file as the model path")
    if gguf_path is not None:
        from .gguf_cache import open_gguf

        gguf = open_gguf(Path(gguf_path))
        return gguf if quantization == "gguf" else DenseView(gguf)
    from .quantized_checkpoint import QuantizedCheckpoint, quantization_method

    if quantization_method(model_dir) is None:
        return MappedCheckpoint(model_dir)
    checkpoint = QuantizedCheckpoint(model_dir)
    return DenseView(checkpoint) if quantization == "none" else checkpoint
