"""The GPU path, where CUDA exists: weights, KV cache and every step tensor on the GPU, bf16
against fp32 at every greedy token, compiled steps captured as CUDA graphs (fp32 and bf16), the
draft on the GPU, NCCL shard groups of one GPU (and of two where two exist), and the padded
all-to-all captured in a CUDA graph with no host sync. Elsewhere every test here is skipped,
saying why (the CPU suite covers the same code paths with device "cpu":
tests/model_shards/test_device.py, test_padded_dispatch.py).

bf16 and fp32 may pick different greedy tokens where fp32's two best logits nearly tie: a
divergence is allowed only where fp32's best logit leads its second by less than LEAD_TOL. On the
same token sequences most positions' bf16 logits stay within LOGIT_TOL of fp32's; a few are
further off, where a near-tie in a router sends a token to another expert in one precision.
Both tolerances come from the demo model in bf16 and fp32 on the CPU (same prompts): flips only
where fp32 led by under a third of LEAD_TOL, the median error a quarter of LOGIT_TOL."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")

PROMPTS = ["Hello", "What does the mawa cake cost?", "Order 3 coffees", "Menu?", "Pickup at noon",
           "Do you have mawa cake today?", "Is the mawa cake eggless?", "Do you deliver on Sundays?",
           "I want to order a birthday cake for 12 people"]
MAX_TOKENS = 24
LEAD_TOL = 1.0
LOGIT_TOL = 0.5  # the median over positions of the largest logit error


@pytest.fixture(scope="module")
def demo():
    from moeserve.engine.factory import demo_checkpoint

    return demo_checkpoint("demo-moe")


def greedy():
    from moeserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def engine(speculation: str, **kw):
    from moeserve.config import AppConfig
    from moeserve.engine.factory import build_engine

    return build_engine(AppConfig.from_options(draft=speculation, device="cuda", max_num_seqs=16, max_model_len=256, **kw))


def teacher_forced(runner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] predicting each of `tokens` after `prompt` and the tokens before it."""
    from moeserve.engine.model_runner import Row

    runner.add("tf")
    out = runner.forward([Row("tf", prompt + tokens[:-1], 0)], logits="all")[0]  # [P + T - 1, V]
    runner.remove("tf")
    return out[len(prompt) - 1 :].float()


def lead(logits: torch.Tensor) -> torch.Tensor:
    """How far the best logit leads the second, per position: logits [T, V] -> [T]."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@pytest.fixture(scope="module")
def reference(demo):
    """fp32 on the GPU: the prompts' ids, their greedy tokens, and the logits along those tokens."""
    from model_shards import load_checkpoint
    from moeserve.engine import ModelRunner
    from moeserve.tokenizer import load_tokenizer

    tok = load_tokenizer(demo)
    prompts = [tok.encode(p) for p in PROMPTS]
    tokens = [c.token_ids for c in engine(dtype="float32", speculation="none").generate(prompts, greedy())]
    runner = ModelRunner(load_checkpoint(demo, torch.float32, device="cuda"), 2, 256)
    return prompts, tokens, [teacher_forced(runner, p, t) for p, t in zip(prompts, tokens)]


def assert_follows(got: list[list[int]], reference, what: str) -> None:
    """Each row equals fp32's greedy tokens up to a divergence where fp32's lead is under LEAD_TOL."""
    _, want, logits = reference
    for i, (g, w, lg) in enumerate(zip(got, want, logits)):
        assert len(g) == len(w) == MAX_TOKENS, what
        j = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if j is not None:
            assert lead(lg[j : j + 1]).item() < LEAD_TOL, (
                f"{what}: prompt {i} leaves fp32's tokens at {j}, where fp32 leads by {lead(lg[j:j + 1]).item():.3f}")


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


def test_bf16_logits_stay_near_fp32_at_every_position(demo, reference):
    """On fp32's own token sequences: bf16's logits near fp32's (the median position within
    LOGIT_TOL), and bf16's greedy pick the same as fp32's at every position where fp32 leads by
    LEAD_TOL or more."""
    from model_shards import load_checkpoint
    from moeserve.engine import ModelRunner

    runner = ModelRunner(load_checkpoint(demo, torch.bfloat16, device="cuda"), 2, 256)
    prompts, tokens, logits = reference
    errors = []
    for i, (p, t, l32) in enumerate(zip(prompts, tokens, logits)):
        l16 = teacher_forced(runner, p, t)
        errors.append((l16 - l32).abs().amax(dim=-1))  # [T]
        flips = l16.argmax(-1) != l32.argmax(-1)  # [T]
        assert bool((lead(l32)[flips] < LEAD_TOL).all()), f"prompt {i}: bf16 flips a clear fp32 choice"
    assert torch.cat(errors).median().item() < LOGIT_TOL


def test_bf16_engine_with_its_draft_follows_fp32(reference):
    bf16 = engine(speculation="model")
    assert bf16.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert bf16.proposer.runner.model.device.type == "cuda"
    assert_follows([c.token_ids for c in bf16.generate(reference[0], greedy())], reference, "bf16 engine")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_captures_cuda_graphs_and_matches_eager(reference, dtype):
    out = {}
    for compiled in (False, True):
        e = engine(dtype=dtype, speculation="ngram", compile=compiled)
        out[compiled] = [c.token_ids for c in e.generate(reference[0], greedy())]
        if compiled:
            assert e.runner.compiled.static and e.runner.compiled.num_calls > 0
    if dtype == "float32":
        assert out[True] == out[False]
    else:  # fused kernels round bf16 differently from eager ones: both follow fp32
        assert_follows(out[False], reference, "bf16 eager")
        assert_follows(out[True], reference, "bf16 CUDA graphs")


@pytest.mark.parametrize("world", [1, 2])
def test_nccl_shard_groups_match_one_process(demo, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs for an NCCL shard group of {world}")
    from bench.local_group import LocalShardGroup
    from model_shards import load_checkpoint
    from moeserve.engine import LLMEngine, ModelRunner

    prompts = [[5, 9, 13, 9], [7, 7, 8, 1, 2], [3, 4], [11, 12, 13, 14, 15, 16]]
    single = LLMEngine(ModelRunner(load_checkpoint(demo, torch.float32, device="cuda:0"), 4, 128))
    want = [c.token_ids for c in single.generate(prompts, greedy())]
    with LocalShardGroup(demo, world, max_num_seqs=4, max_model_len=128, device="cuda", dtype="float32") as runner:
        got = [c.token_ids for c in LLMEngine(runner).generate(prompts, greedy())]
    assert got == want


def test_padded_all_to_all_has_no_host_sync_and_replays_as_a_cuda_graph():
    """An NCCL group of one: the padded layout (bf16, where the grouped matmul reads its group
    ends on the device) equals the exact one, runs under CUDA's sync debug mode set to error,
    and captured once in a CUDA graph replays new routing correctly."""
    import torch.distributed as dist

    from model_shards.all_to_all import AllToAllDispatch, init_shard_group
    from model_shards.local_group import free_port
    from model_shards.moe import LocalExperts
    from router_service.placement import contiguous_placement

    torch.manual_seed(0)
    n, k, e, d = 16, 2, 8, 128
    experts = LocalExperts(range(e), hidden=d, intermediate=64)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    experts = experts.to("cuda", torch.bfloat16)
    init_shard_group(0, 1, f"127.0.0.1:{free_port()}", device="cuda:0")
    try:
        placement = contiguous_placement(e, 1)
        exact, padded = AllToAllDispatch(placement, 0, padded=False), AllToAllDispatch(placement, 0, padded=True)
        padded.max_tokens = n
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, e, (n, k), device="cuda")
        weights = torch.rand(n, k, device="cuda")
        with torch.no_grad():
            want = exact(x, ids, weights, experts)
            torch.testing.assert_close(padded(x, ids, weights, experts), want)  # also makes the tables on the GPU
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                padded(x, ids, weights, experts)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                padded(x, ids, weights, experts)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = padded(x, ids, weights, experts)
            x.copy_(torch.randn_like(x))
            ids.copy_(torch.randint(0, e, (n, k), device="cuda"))
            graph.replay()
            torch.testing.assert_close(out, exact(x, ids, weights, experts))
    finally:
        dist.destroy_process_group()
