"""moeserve: serving Mixture-of-Experts models. The offline API is `LLM` with `SamplingParams`."""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:  # lazy: `import moeserve.sampling_params` need not load torch
    if name == "LLM":
        from moeserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moeserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
