"""Offline Python interface: `LLM(...).generate(prompts, sampling_params)`."""

from .llm import LLM

__all__ = ["LLM"]
