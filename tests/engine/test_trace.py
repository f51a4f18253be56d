"""The per-token trace: each token's experts equal the routing a fresh full forward computes at
the position that chose it (through prefix caching, batching, speculation and the compiled
step); sources say which tokens were accepted drafts; with no trace asked nothing is recorded."""

from __future__ import annotations

import pytest
import torch

from bench.tiny_checkpoint import save_tiny_checkpoint
from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, SpecConfig
from moeserve.engine.model_runner import ModelRunner
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer

TRACED = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, trace_experts=True, trace_speculation=True)
PROMPTS = [[5, 9, 13, 9, 13, 9, 13, 9], [7, 7, 8, 7, 7, 8], [11, 3, 11, 3, 11, 3, 11, 4, 11, 3]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))


def run(engine: LLMEngine, prompts, params) -> dict[str, tuple[list[int], list]]:
    ids = [engine.add_request(p, params) for p in prompts]
    out = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            if o.trace is not None:
                out[o.request_id][1].extend(o.trace)
    return [out[rid] for rid in ids]


def reference_routing(model, tokens: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, expert ids [T, K], weights [T, K]) of one full forward without a cache."""
    trace = model.record_routing(True)
    try:
        model(torch.tensor([tokens]))
        return [(layer, ids, w) for layer, ids, w in trace]
    finally:
        model.record_routing(False)


@pytest.mark.parametrize("compiled", [False, True])
def test_traced_experts_equal_a_fresh_forward_and_sources_match_acceptance(folder, compiled):
    model = load_checkpoint(folder)
    runner = ModelRunner(model, 4, 128, num_blocks=64, block_size=4, compile=compiled)
    engine = LLMEngine(runner, proposer=NgramProposer(), spec=SpecConfig(num_tokens=3))
    results = run(engine, PROMPTS, TRACED)
    reference_model = load_checkpoint(folder)
    moe_layers = [b.layer_idx for b in model.moe_blocks]
    drafted = 0
    for prompt, (tokens, trace) in zip(PROMPTS, results):
        assert [e.token_id for e in trace] == tokens and len(tokens) == TRACED.max_tokens
        reference = reference_routing(reference_model, prompt + tokens)
        for j, e in enumerate(trace):
            at = len(prompt) - 1 + j  # the position whose output chose token j
            assert [layer for layer, _, _ in e.experts] == moe_layers
            for (layer, ids, weights), (ref_layer, ref_ids, ref_w) in zip(e.experts, reference):
                assert layer == ref_layer and list(ids) == ref_ids[at].tolist()
                torch.testing.assert_close(torch.tensor(weights), ref_w[at], atol=1e-3, rtol=0)
        drafted += sum(e.source == "draft" for e in trace)
        assert {e.source for e in trace} <= {"draft", "target"} and trace[0].source == "target"
    assert drafted == engine.spec_metrics.num_accepted_tokens > 0  # the repeating prompts let n-grams draft


def test_without_a_trace_nothing_is_recorded(folder):
    model = load_checkpoint(folder)
    engine = LLMEngine(ModelRunner(model, 4, 128, num_blocks=64, block_size=4))
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (tokens, trace), = run(engine, PROMPTS[:1], plain)
    assert trace == [] and model.routing_trace is None and all(b.trace is None for b in model.moe_blocks)
    (traced_tokens, traced), = run(engine, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0,
                                                                        ignore_eos=True, trace_speculation=True))
    assert traced_tokens == tokens and [e.source for e in traced] == ["target"] * 6
    assert all(e.experts is None for e in traced) and model.routing_trace is None  # sources only: no routing
