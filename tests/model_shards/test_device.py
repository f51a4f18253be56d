"""Device and dtype from the config to the weights, the KV cache and each step: what can be
checked without a GPU (tests/gpu/ runs the CUDA path where one exists)."""

from __future__ import annotations

import pytest
import torch

from model_shards import load_checkpoint
from model_shards.device import collective_backend, resolve_device, resolve_dtype
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.engine.factory import demo_checkpoint, engine_device, engine_dtype
from moeserve.engine.model_runner import Row
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import load_tokenizer


def test_auto_means_the_gpu_when_there_is_one_and_its_precision():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    cfg = AppConfig()
    assert cfg.engine.device == "auto" and engine_device(cfg).type == want
    assert engine_dtype(cfg) == (torch.bfloat16 if want == "cuda" else torch.float32)


def test_bad_devices_and_dtypes_say_what_is_allowed():
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="device"):
        AppConfig.from_options(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="num_gpus"):
            resolve_device("cuda")


def test_the_collective_backend_follows_the_tensors_device():
    assert collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend(torch.device("cuda")) == "nccl"
    assert collective_backend(torch.device("cuda:1")) == "nccl"


def test_a_bf16_model_keeps_weights_cache_and_activations_in_bf16():
    """dtype reaches every weight and the KV cache; the step's matmuls run in bf16 (checked on
    every matmul the forward issues) and logits come back as float32 on the CPU."""
    aten = torch.ops.aten
    path = demo_checkpoint("demo-moe")
    model = load_checkpoint(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    runner = ModelRunner(model, 2, 64)
    assert all(t.dtype == torch.bfloat16 and t.device == model.device for t in runner.cache.kv)

    seen: list[torch.dtype] = []

    class Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (aten.linear, aten.mm, aten.bmm, aten.addmm, aten._grouped_mm):
                seen.extend(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
            return func(*args, **(kwargs or {}))

    runner.add("a")
    prompt = load_tokenizer(path).encode("Hello, what is on the menu today?")
    with Matmuls():
        logits = runner.forward([Row("a", prompt, 0)])
    assert seen and set(seen) == {torch.bfloat16}
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    first = runner.manager.tables["a"][0]
    assert runner.cache.kv[0][0, :, first].abs().sum() > 0  # the prompt's keys were written

    reference = ModelRunner(load_checkpoint(path), 2, 64)
    reference.add("a")
    want = reference.forward([Row("a", prompt, 0)])
    assert torch.nn.functional.cosine_similarity(logits, want).item() > 0.99


def test_an_engine_built_for_bf16_generates():
    cfg = AppConfig.from_options(draft="model", dtype="bfloat16", max_num_seqs=2, max_model_len=128)
    from moeserve.engine.factory import build_engine

    engine: LLMEngine = build_engine(cfg)
    assert engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.proposer.runner.model.lm_head.weight.dtype == torch.bfloat16  # the draft too
    out = engine.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_auto_says_in_the_log_what_it_picked(caplog):
    from model_shards import device as device_mod

    device_mod._auto_device.cache_clear()
    with caplog.at_level("INFO", logger="model_shards.device"):
        picked = resolve_device("auto")
        resolve_device("auto")
    said = [r.getMessage() for r in caplog.records if r.name == "model_shards.device"]
    assert len(said) == 1 and said[0].startswith(f"device auto: {picked.type}")  # once a process


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_cuda_without_a_gpu_is_a_start_error_for_the_engine_and_the_draft():
    """The engine with its in-process draft and a draft deployment's worker both refuse at start."""
    from deployments.draft_worker import DraftServerConfig, DraftWorker
    from moeserve.engine.factory import build_engine

    with pytest.raises(ValueError, match="no CUDA GPU"):
        build_engine(AppConfig.from_options(draft="model", device="cuda"))
    with pytest.raises(ValueError, match="no CUDA GPU"):
        DraftWorker(DraftServerConfig(demo_checkpoint("demo-draft"), device="cuda"))
