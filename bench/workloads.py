"""The workloads the benches time: our engine and transformers `generate` on the same prompts.

Greedy everywhere, so every way of decoding writes the same tokens: either exactly
`new_tokens` per prompt (EOS ignored on both sides), or up to the model's end of turn
(`stop_at_eos`, batch 1 only on the transformers side; the end token itself is not
counted on either side). Batch 1 runs the prompts one after another; batch B runs them as
one batch (transformers: left padding).
"""

from __future__ import annotations

import time

import torch

from bench.timing import Case
from moeserve.engine import LLMEngine
from moeserve.sampling_params import SamplingParams
from moeserve.spec import SpecMetrics


def greedy(new_tokens: int, stop_at_eos: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=not stop_at_eos)


def ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, batch: int, stop_at_eos: bool = False,
         grammar=None, continuous: bool = False) -> Case:
    """Our engine: prompts in groups of `batch` (each constrained by `grammar`, a CompiledGrammar,
    when given: then a reply ends where its grammar completes); `continuous`: all queued at once,
    so an engine holding `batch` sequences refills a finished row's place as a server does (steps
    then mix prefill and decode: extra has the total seconds only). extra: this run's speculation
    metrics, the time split into prefill (each group's first step) and decode steps, and with a
    draft deployment its pre-draft hit rate, share of steps answered from a push, wait per call and
    fallback steps."""
    params = greedy(new_tokens, stop_at_eos)

    stats = getattr(engine.proposer, "stats", None)  # a draft deployment's counters (pre-draft hits, waits)

    def case() -> tuple[int, dict]:
        engine.spec_metrics = SpecMetrics()  # this run's only
        before = stats() if stats else None
        tokens, prefill_s, decode_s, decode_steps = 0, 0.0, 0.0, 0
        for i in range(0, len(prompts), len(prompts) if continuous else batch):
            for p in prompts[i : len(prompts) if continuous else i + batch]:
                engine.add_request(p, params, grammar=grammar)
            t0 = time.perf_counter()
            tokens += sum(len(o.new_token_ids) for o in engine.step())  # prefill: the whole group at once
            prefill_s += time.perf_counter() - t0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                tokens += sum(len(o.new_token_ids) for o in engine.step())
                decode_s += time.perf_counter() - t0
                decode_steps += 1
        extra = ({"steps_s": prefill_s + decode_s} if continuous else
                 {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": decode_steps,
                  "decode_tokens": tokens - len(prompts)})
        if engine.proposer is not None:
            extra["spec"] = engine.spec_metrics.to_dict()
        if stats:
            after = stats()
            calls, proposals = after["calls"] - before["calls"], after["proposals"] - before["proposals"]
            extra["draft"] = {"predraft_hit_rate": (after["predraft_hits"] - before["predraft_hits"]) / max(proposals, 1),
                              "wait_ms_per_call": 1e3 * (after["wait_s"] - before["wait_s"]) / max(calls, 1),
                              "fallback_steps": after["fallback_steps"] - before["fallback_steps"]}
        return tokens, extra

    return case


def ours_outputs(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, greedy(new_tokens))]


def hf(model, prompts: list[list[int]], new_tokens: int, batch: int, assistant=None, stop_at_eos: bool = False) -> Case:
    """transformers `generate` (assisted when `assistant` is given; it only supports batch 1)."""
    if (assistant is not None or stop_at_eos) and batch != 1:
        raise ValueError("assisted generation and stopping at EOS are compared at batch 1 only")

    def case() -> tuple[int, dict]:
        tokens = 0
        for i in range(0, len(prompts), batch):
            out = hf_generate(model, prompts[i : i + batch], new_tokens, assistant, stop_at_eos)
            tokens += sum(len(o) for o in out)
        return tokens, {}

    return case


@torch.inference_mode()
def hf_generate(
    model, prompts: list[list[int]], new_tokens: int, assistant=None, stop_at_eos: bool = False
) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T] left-padded with 0 (pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    extra = {"assistant_model": assistant} if assistant is not None else {}
    if not stop_at_eos:
        extra["eos_token_id"] = None
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra)
    rows = out[:, width:].tolist()
    if stop_at_eos:  # batch 1: the end token is generated but, as in our engine, not counted
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        rows = [r[:-1] if r and r[-1] in eos else r for r in rows]
    return rows


def load_hf(path: str, num_assistant_tokens: int | None = None, compiled: bool = False):
    """A transformers model in eval mode; as an assistant, with a constant number of draft tokens;
    `compiled`: with its static KV cache and its forward under `torch.compile` (transformers'
    own recipe for fast generation)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    if compiled:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward)
    if num_assistant_tokens is not None:
        model.generation_config.num_assistant_tokens = num_assistant_tokens
        model.generation_config.num_assistant_tokens_schedule = "constant"
        model.generation_config.assistant_confidence_threshold = 0.0
    return model
