"""Per-request sampling parameters, named as in vLLM and the OpenAI API; a bad value raises a
ValueError naming the field (HTTP 400, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Temperatures below this are greedy (as in vLLM): dividing logits by ~0 only amplifies rounding noise.
SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 100.0
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(name: str, value: object) -> tuple:
    """Accept a tuple, a list (JSON arrays arrive as lists) or any other non-string iterable."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of values, got {type(value).__name__}")
    return tuple(value)


# Each stop string is searched for in every streamed chunk: bound how much work one request can ask for.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was drawn from, and the
    most likely tokens of that distribution (`SamplingParams.logprobs` of them, best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenTrace:
    """How one generated token came to be (an opt-in trace).

    source: "target" (drawn from the target's distribution: a plain step, or a recovered or bonus
        token), "draft" (an accepted draft token) or "forced" (jump-forward); None unless asked.
    experts: per MoE layer, (layer index, expert ids, gate weights) at the position whose output
        chose this token; None unless asked, and for forced tokens (no pass chose them)."""

    token_id: int
    source: str | None = None
    experts: tuple[tuple[int, tuple[int, ...], tuple[float, ...]], ...] | None = None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The offline API's structured output, as vLLM names it: exactly one of a JSON schema (a dict
    or its text), a regex, an EBNF grammar, a list of choices, or any JSON object. The served API
    takes the same through `response_format` and `guided_*`; both fail with the same GrammarError."""

    json: dict | str | bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    json_object: bool = False

    def spec(self):
        """The GrammarSpec (moeserve.grammar) this asks for; GrammarError (a ValueError) if malformed."""
        from moeserve.grammar.spec import GrammarSpec

        spec = GrammarSpec.from_request(response_format={"type": "json_object"} if self.json_object else None,
                                        guided_json=self.json, guided_regex=self.regex, guided_grammar=self.grammar,
                                        guided_choice=None if self.choice is None else list(self.choice))
        if spec is None:
            raise ValueError("structured_outputs: set one of json, regex, grammar, choice or json_object")
        return spec


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples tokens (temperature, then top-k, then top-p; temperature 0: greedy;
    top_k 0 or -1 and top_p 1: off) and when it stops.

    seed: keys this request's draws by (seed, position): the same tokens whatever the batch,
        with or without speculation and after a resume; None: the shared generator.
    stop, stop_token_ids: end generation, left out of the output (stop may be a string or a list).
    logprobs: None (off), or each token's log-probability and this many alternatives, from the
        final distribution it was drawn from (greedy requests: the model's masked distribution).
    trace_experts, trace_speculation: see TokenTrace.
    structured_outputs: constrains the output (the offline API, `LLM`; checked when the request is added).
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    trace_experts: bool = False
    trace_speculation: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {self.temperature!r}"
            )

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 to turn it off, got {self.top_k!r}")

        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")

        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be null or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")

        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop must not contain an empty string (it would match before any text)")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
        object.__setattr__(self, "stop", stop)

        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
        for t in stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only integers >= 0, got {t!r}")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        for name in ("ignore_eos", "trace_experts", "trace_speculation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0, or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1
