"""moeserve: serving Mixture-of-Experts models. The offline API is `LLM` with `SamplingParams`
(and `StructuredOutputsParams` for constrained output)."""

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:  # lazy: `import moeserve.sampling_params` need not load torch
    if name == "LLM":
        from moeserve.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from moeserve import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
