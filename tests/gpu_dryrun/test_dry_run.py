"""The GPU dry run (bench/dry_run.py): the three shipped shapes at full size on `meta`, through load,
prefill, decode and verify of an expert-parallel rank; zero host syncs in decode and verify on
the padded all-to-all; memory per GPU within 5% of bench.scale_model; and negative controls: a
tensor made on the CPU, a dtype mix and a host sync each fail the run, saying where."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from bench import dry_run
from model_shards.config import ModelConfig
from model_shards.kv_cache import StepBatch
from model_shards.model import DecoderLayer
from model_shards.moe import MoEBlock


@pytest.fixture(scope="module", params=[("mixtral-8x7b", 8), ("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 1), ("deepseek-v3", 16)])
def result(request):
    name, gpus = request.param
    return _run(name, gpus)


@functools.cache
def _run(name: str, gpus: int) -> dry_run.DryRun:
    return dry_run.dry_run(name, gpus=gpus, batch=64 if gpus > 1 else 8, context=2048 if gpus > 1 else 512)


def test_decode_and_verify_have_no_host_sync(result):
    assert result.syncs["decode"] == 0 and result.syncs["verify"] == 0
    moe_layers = sum(ModelConfig.from_hf(dry_run.shape_of(result.model)).sparse_layers)
    assert result.syncs["prefill"] == 2 * moe_layers  # the exact all-to-all's two reads a layer, answered


def test_memory_agrees_with_the_scale_model(result):
    for part, ratio in result.agreement().items():
        assert abs(ratio - 1) <= 0.05, (part, ratio)
    assert result.loaded == result.weights  # the loader read exactly this rank's tensors
    assert 0 < result.workspace["decode"] <= result.workspace["prefill"]


def test_report_says_passed(result):
    text = dry_run.report(result)
    assert "passed" in text and "KV cache" in text and "workspace" in text


def _small(**kw):
    return dry_run.dry_run("qwen3-30b-a3b", gpus=8, batch=4, context=128, prompt=80, **kw)  # prefill: the exact layout


def test_a_tensor_made_on_the_cpu_fails_the_run():
    real = DecoderLayer.attend

    def misplaced(self, x, rope, kv, index, qkv=None):
        x, h = real(self, x, rope, kv, index, qkv)
        return x + torch.zeros(x.shape[-1], dtype=x.dtype), h  # no device: lands on the CPU

    with mock.patch.object(DecoderLayer, "attend", misplaced), pytest.raises(RuntimeError, match="cpu"):
        _small()


def test_a_cpu_index_into_a_device_tensor_fails_a_decode_pass():
    # meta (like CUDA) accepts a CPU index tensor; in a decode pass the dry run refuses it
    real = MoEBlock.after_gating

    def cpu_index(self, x, gates, shared):
        return real(self, x[torch.arange(x.shape[0])], gates, shared)

    with mock.patch.object(MoEBlock, "after_gating", cpu_index), \
            pytest.raises(dry_run.DryRunError, match="decode: .* made a tensor on the CPU"):
        _small()


def test_a_dtype_mix_fails_the_run():
    real = MoEBlock.forward

    def upcast(self, x):
        return real(self, x.float()).to(x.dtype)  # the router's matmul: fp32 input, bf16 weight

    with mock.patch.object(MoEBlock, "forward", upcast), pytest.raises(dry_run.DryRunError, match="mixes dtypes"):
        _small()


def test_a_host_sync_in_decode_fails_the_run():
    real = DecoderLayer.attend

    def reads_back(self, x, rope, kv, index, qkv=None):
        if x.shape[1] == 1 and bool(x.isnan().any()):  # a decode-only check that reads a value on the host
            raise ValueError("nan")
        return real(self, x, rope, kv, index, qkv)

    with mock.patch.object(DecoderLayer, "attend", reads_back), \
            pytest.raises(dry_run.DryRunError, match=r"decode: host sync .*model\.py"):
        _small()


def test_experts_without_the_grouped_kernel_sync():
    # a GPU without torch's grouped GEMM sizes each expert's rows on the host
    with mock.patch.object(dry_run, "experts_grouped_on_gpu", lambda x, w: False), \
            pytest.raises(dry_run.DryRunError, match=r"host sync .*(experts|moe)\.py"):
        _small()


def test_step_batch_from_device_tensors_reads_back_but_from_host_lists_does_not():
    on = dict(block_size=16, device="meta")
    with dry_run.PassAudit("decode", True, None):
        StepBatch.build([[1, 2]], [17], [1], **on).prepare(1)
    start = torch.tensor([17], device="meta")
    with dry_run.PassAudit("decode", True, None), pytest.raises(dry_run.DryRunError, match="host sync"):
        StepBatch(torch.tensor([[1, 2]], device="meta"), start, torch.ones_like(start), 16).prepare(1)


def test_deepseek_v3_runs_latent_attention_and_its_gate():
    # the latent cache (576 values a token and layer) and the 3 dense layers before the MoE ones
    r = _run("deepseek-v3", 16)
    cfg = ModelConfig.from_hf(dry_run.shape_of("deepseek-v3"))
    blocks = 64 * 2048 // 16 + 1  # the budget's blocks and the scratch block
    assert r.kv_cache == blocks * 16 * cfg.num_layers * 576 * 2  # bf16
    assert sum(cfg.sparse_layers) == cfg.num_layers - 3 and r.syncs["decode"] == 0


def test_an_unknown_shape_is_refused_by_name():
    with pytest.raises(SystemExit, match="no model shape 'gpt-5'"):
        dry_run.dry_run("gpt-5")


@functools.cache
def _compiled() -> dry_run.DryRun:
    # full width, two layers (every layer runs the same code); dynamo traces, the graphs run audited
    return dry_run.dry_run("qwen3-30b-a3b", gpus=1, batch=8, context=256, compiled=True, layers=2)


def test_a_compiled_decode_step_has_no_host_sync():
    r = _compiled()
    assert r.graphs == 2 and r.syncs["decode"] == 0 and r.syncs["verify"] == 0  # decode's graph, verify's


def test_a_host_sync_in_a_compiled_step_fails_the_run():
    real = DecoderLayer.attend

    def reads_back(self, x, rope, kv, index, qkv=None):
        if x.shape[1] == 1:  # decode only (prefill is eager): a value read on the host breaks the graph
            x = x * (x.abs().amax().item() > -1)
        return real(self, x, rope, kv, index, qkv)

    torch._dynamo.reset()
    with mock.patch.object(DecoderLayer, "attend", reads_back), \
            pytest.raises(dry_run.DryRunError, match=r"decode: host sync in the compiled step .*item"):
        dry_run.dry_run("qwen3-30b-a3b", gpus=1, batch=2, context=64, prompt=16, compiled=True, layers=1)


def test_a_compiled_expert_parallel_rank_has_no_host_sync():
    # DeepSeek-V3's 3 dense layers and 2 MoE ones: per-layer graphs around the padded all-to-all,
    # which runs eagerly under the audit (latent attention: no stacked q/k/v weights)
    r = dry_run.dry_run("deepseek-v3", gpus=8, batch=8, context=256, compiled=True, layers=5)
    assert r.graphs >= 2 and r.syncs["decode"] == 0 and r.syncs["verify"] == 0
