"""The GPU path, where CUDA exists: weights, KV cache and every step tensor on the GPU in bf16,
compiled steps captured as CUDA graphs, the draft on the GPU, NCCL between two GPU ranks.
Elsewhere every test here is skipped, saying why (the CPU suite covers the same code paths
with device "cpu": tests/model_shards/test_device.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")


@pytest.fixture(scope="module")
def demo():
    from moeserve.engine.factory import demo_checkpoint

    return demo_checkpoint("demo-moe")


def test_everything_a_step_touches_is_on_the_gpu(demo):
    from model_shards import load_checkpoint
    from moeserve.engine import ModelRunner
    from moeserve.engine.model_runner import Row

    model = load_checkpoint(demo, torch.bfloat16, device="cuda")
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", torch.bfloat16)}
    assert model.model.rotary.inv_freq.device.type == "cuda"
    runner = ModelRunner(model, 2, 128)
    assert all(t.device.type == "cuda" for t in runner.cache.kv)
    cpu_tensors = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "copy" not in str(func) and "_to_copy" not in str(func):  # the final logits copy is meant
                cpu_tensors.extend(str(func) for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"
                                   and a.dim() > 0)
            return out

    runner.add("a")
    with Watch():
        logits = runner.forward([Row("a", [5, 6, 7, 8], 0)])
        runner.forward([Row("a", [9], 4)])
    assert logits.device.type == "cpu" and logits.shape == (1, model.config.vocab_size)
    assert cpu_tensors == [], f"ops on CPU tensors during a GPU step: {sorted(set(cpu_tensors))}"


def test_bf16_on_the_gpu_agrees_with_fp32_on_the_cpu(demo):
    from moeserve.engine.factory import EngineConfig, build_engine
    from moeserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "Do you have mawa cake today?"
    gpu = build_engine(EngineConfig(device="cuda", speculation="model", max_num_seqs=4, max_model_len=256))
    cpu = build_engine(EngineConfig(device="cpu", speculation="none", max_num_seqs=4, max_model_len=256))
    assert gpu.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert gpu.proposer.runner.model.device.type == "cuda"
    a, b = gpu.generate([prompt], params)[0].token_ids, cpu.generate([prompt], params)[0].token_ids
    assert a[:4] == b[:4]  # bf16 may drift later; the first tokens of a trained model agree


def test_compiled_step_captures_cuda_graphs_and_matches_eager(demo):
    from moeserve.engine.factory import EngineConfig, build_engine
    from moeserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["Hello", "What does the mawa cake cost?", "Order 3 coffees", "Menu?", "Pickup at noon"]
    out = {}
    for compiled in (False, True):
        engine = build_engine(EngineConfig(device="cuda", dtype="float32", speculation="ngram", compile=compiled,
                                           max_num_seqs=8, max_model_len=256))
        out[compiled] = [c.token_ids for c in engine.generate(prompts, params)]
        if compiled:
            assert engine.runner.compiled.static and engine.runner.compiled.num_calls > 0
    assert out[True] == out[False]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for an NCCL shard group")
def test_two_gpu_ranks_over_nccl_match_one(demo, tmp_path):
    from model_shards import load_checkpoint
    from model_shards.local_group import LocalShardGroup
    from moeserve.engine import LLMEngine, ModelRunner
    from moeserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 9], [7, 7, 8, 1, 2]]
    single = LLMEngine(ModelRunner(load_checkpoint(demo, torch.float32, device="cuda:0"), 4, 128))
    want = [c.token_ids for c in single.generate(prompts, params)]
    with LocalShardGroup(demo, 2, max_num_seqs=4, max_model_len=128, device="cuda", dtype="float32") as runner:
        got = [c.token_ids for c in LLMEngine(runner).generate(prompts, params)]
    assert got == want
