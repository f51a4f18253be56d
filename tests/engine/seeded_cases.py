"""Seeded requests on the demo pair, and how to run them alone, amid a crowd, or resumed (test helper).

A case is one seeded request (a demo chat prompt, its sampling parameters, with or without a
JSON schema). `run` drives an engine to completion and records, besides each request's tokens,
the logits every sampled token was drawn from, keyed by (case label, absolute position): the
tests compare both across batch compositions and runners.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moeserve.engine import LLMEngine
from moeserve.grammar import CompiledGrammar, GrammarSpec
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import render_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 12},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "pickup": {"type": "boolean"},
    },
    "required": ["item", "qty", "pickup"],
    "additionalProperties": False,
}
SCHEMA_SPEC = GrammarSpec.json_schema(SCHEMA)
# replies the demo model is unsure of (order ids, names, items): different seeds, different replies
QUESTIONS = ("Order two croissants for pickup, as JSON.", "What should I bring to a party?",
             "Hi! Can you make a custom chocolate cake, 2 kg, for 14 March?")
# temperature > 0 throughout; the second seed also cuts to a nucleus
PARAMS = (SamplingParams(max_tokens=32, temperature=0.8, seed=11),
          SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=2**40 + 3))
SCHEMA_MAX_TOKENS = 48  # room to close the object: the schema's replies are checked complete


@dataclass(frozen=True)
class Case:
    label: str
    prompt: str
    params: SamplingParams
    schema: bool


def cases(tokenizer, schema: bool) -> list[Case]:
    out = []
    for q, question in enumerate(QUESTIONS):
        prompt = render_chat(tokenizer, [{"role": "user", "content": question}])
        for s, params in enumerate(PARAMS):
            if schema:
                params = replace(params, max_tokens=SCHEMA_MAX_TOKENS)
            out.append(Case(f"{'schema' if schema else 'free'}-q{q}-p{s}", prompt, params, schema))
    return out


def crowd(tokenizer, grammar: CompiledGrammar, n: int = 15) -> list[tuple[str, SamplingParams, CompiledGrammar | None]]:
    """`n` other requests: prompts of about 10 to 100 tokens, greedy and sampled (seeded or not,
    top-k, top-p), up to 40 tokens, some under the schema."""
    g = torch.Generator().manual_seed(0)
    topics = ("eggless cakes", "a refund", "delivery to Salt Lake", "store hours", "the price of rusks",
              "a birthday order", "allergens in the brownie", "my order status")
    out = []
    for i in range(n):
        topic = topics[i % len(topics)]
        if i % 3 == 0:
            prompt = f"Tell me about {topic}."  # raw text, no chat template
        else:
            system = "You are the bakery's assistant. " * int(torch.randint(0, 12, (1,), generator=g))
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"Question {i} about {topic}?"}]
            prompt = render_chat(tokenizer, messages)
        kind = i % 5
        params = SamplingParams(
            max_tokens=int(torch.randint(3, 41, (1,), generator=g)),
            temperature=0.0 if kind == 0 else (0.5, 1.0, 1.3, 0.9)[kind - 1],
            top_k=8 if kind == 2 else 0,
            top_p=0.7 if kind == 3 else 1.0,
            seed=None if kind in (1, 4) else 1000 + i,
            ignore_eos=kind == 4,
        )
        out.append((prompt, params, grammar if i % 4 == 1 else None))
    return out


@dataclass
class Result:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # by label
    finish: dict[str, str] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (label, position) -> [V] drawn from


Job = tuple[str | None, str, SamplingParams, CompiledGrammar | None, list[int]]  # label, prompt, params, grammar, resume


def run(engine: LLMEngine, jobs: list[Job], into: Result | None = None) -> Result:
    """Run the jobs together to completion (unlabelled ones are the crowd); a resumed job's tokens
    include its resume_ids. Records the raw logits (before any grammar mask) of every sampled position."""
    result = into if into is not None else Result()
    labels: dict[str, str] = {}
    sample_next = engine._sample_next

    def recording(seqs, logits):
        for i, s in enumerate(seqs):
            if s.seq_id in labels:
                result.logits[labels[s.seq_id], s.num_tokens] = logits[i].detach().clone()
        return sample_next(seqs, logits)

    engine._sample_next = recording
    try:
        for label, prompt, params, grammar, resume in jobs:
            rid = engine.add_request(prompt, params, grammar=grammar, resume_ids=resume)
            if label is not None:
                labels[rid] = label
                result.tokens[label] = list(resume)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in labels:
                    result.tokens[labels[out.request_id]] += out.new_token_ids
                    if out.finished:
                        result.finish[labels[out.request_id]] = out.finish_reason
    finally:
        del engine._sample_next
    return result


@dataclass
class Runs:
    """One runner's replies to every case: alone (one at a time), amid the crowd (all cases and
    the crowd at once), and resumed from proper prefixes of its alone reply (label@cut)."""

    tokenizer: object
    cases: list[Case]
    alone: Result
    amid: Result
    resumed: Result


def run_matrix(engine: LLMEngine, grammar: CompiledGrammar, cut_every: int = 1) -> Runs:
    """Every case alone, amid the crowd, and resumed from every `cut_every`-th proper prefix."""
    all_cases = cases(engine.tokenizer, schema=False) + cases(engine.tokenizer, schema=True)
    job = {c.label: (c.label, c.prompt, c.params, grammar if c.schema else None) for c in all_cases}
    alone = Result()
    for c in all_cases:
        run(engine, [(*job[c.label], [])], into=alone)
    jobs: list[Job] = [(None, p, params, g, []) for p, params, g in crowd(engine.tokenizer, grammar)]
    for i, c in enumerate(all_cases):  # the crowd's requests around and between the cases
        jobs.insert(2 * i + 1, (*job[c.label], []))
    amid = run(engine, jobs)
    resumed = [(f"{c.label}@{cut}", *job[c.label][1:], alone.tokens[c.label][:cut])
               for c in all_cases for cut in range(1, len(alone.tokens[c.label]), cut_every)]
    return Runs(engine.tokenizer, all_cases, alone, amid, run(engine, resumed))
