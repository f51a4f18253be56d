"""DeepSeek-V3: its config (the full-size shape and refused bad ones), a second checkpoint variant
against transformers, the latent KV cache against a plain per-head one, and greedy decoding through
the engine (paged cache, prefix hits, speculation) against transformers' generate. Logits of the
main tiny variant: tests/model_shards/test_hf_oracle.py; W = 2 expert parallelism:
tests/model_shards/test_expert_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.scale_model import load_shape
from model_shards import PagedKVCache, StepBatch, load_checkpoint
from model_shards.config import ModelConfig
from model_shards.layers import gather_blocks, write_entries
from moeserve.engine import LLMEngine, ModelRunner, SpecConfig
from moeserve.sampling_params import SamplingParams
from moeserve.spec.ngram import NgramProposer
from tests.model_shards.hf_tiny import fuse_experts, save_tiny

SHAPE = Path(__file__).parents[2] / "bench" / "shapes" / "deepseek-v3.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, save_tiny("deepseek_v3", folder)


def test_full_size_config_loads_with_its_latent_cache_entry():
    cfg = ModelConfig.from_file(SHAPE)
    assert cfg.is_mla and cfg.kv_entry == (1, 1, 512 + 64)  # 576 values a token and layer
    assert cfg.sparse_layers[:4] == (False, False, False, True) and sum(cfg.sparse_layers) == 58
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    assert cfg.gate_style == "sigmoid_bias" and cfg.shared_expert_intermediate_size == 2048
    per_head = 2 * 128 * 128  # keys and values of 128 heads of 128
    bf16 = torch.bfloat16
    assert PagedKVCache.block_bytes(cfg, 16, bf16) == 576 * 61 * 16 * 2
    assert PagedKVCache.block_bytes(cfg, 16, bf16) / (per_head * 61 * 16 * 2) == 576 / per_head
    assert load_shape("deepseek-v3").kv_per_token == 576  # the scale model plans the engine's layout


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.original_max_position_embeddings"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({"n_routed_experts": None}, "n_routed_experts"),
    ({"v_head_dim": 0}, "v_head_dim"),
])
def test_bad_configs_are_refused_naming_the_field(change, field):
    hf = {k: v for k, v in (json.loads(SHAPE.read_text()) | change).items() if v is not None}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf(hf)


def test_full_rank_queries_plain_rope_and_fused_experts_match_transformers(tmp_path):
    """The other switches: q_proj without a low-rank query, rotate-half rope without scaling, the
    experts stored fused."""
    import transformers as T

    from tests.model_shards import hf_tiny

    base = hf_tiny.tiny_config("deepseek_v3").to_dict()
    cfg = T.DeepseekV3Config(**base | dict(q_lora_rank=None, rope_interleave=False, rope_scaling=None,
                                           rope_parameters=None, n_group=1, topk_group=1, norm_topk_prob=False))
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    fuse_experts(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.config.q_lora_rank == 0 and ours.config.rope_scaling is None
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits.float(), atol=1e-4, rtol=0)


def test_latent_cache_attention_equals_a_per_head_cache(tiny):
    """Decode (and a three-token verify) read the latent cache with the up-projections absorbed;
    the same attention over a plain paged cache of the per-head keys and values, expanded from
    the same latents, gives the same output. The latent cache is (R + Dr) / (2 H Dh) of its bytes."""
    folder, _ = tiny
    model = load_checkpoint(folder)
    cfg, attn = model.config, model.model.layers[1].self_attn
    x = torch.randn(2, 11, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(11).expand(2, 11)
    tables = [[3, 1, 5], [2, 6, 4]]
    latent_cache = PagedKVCache.for_model(cfg, 7, 4)
    h, dh = cfg.num_heads, cfg.head_dim  # per-head keys of Dn + Dr; values padded with zeros to it
    per_head = PagedKVCache(1, 7, 4, h, dh)
    assert latent_cache.nbytes / cfg.num_layers / per_head.nbytes == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) / (2 * h * dh)

    def step(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rope = model.model.rotary(pos[:, start : start + n], x.dtype)
        index = StepBatch.build(tables, [start] * 2, [n] * 2, 4).prepare(n).index
        got = attn(x[:, start : start + n], rope, latent_cache.kv[1], index)
        q_nope, q_rot, latent = attn.project(x[:, start : start + n], rope)
        c, k_rot = latent.split((cfg.kv_lora_rank, cfg.qk_rope_head_dim), dim=-1)
        k_nope, v = attn.kv_b_proj(c).view(2, n, h, -1).transpose(1, 2).split((cfg.qk_nope_head_dim, cfg.v_head_dim), -1)
        k = torch.cat((k_nope, k_rot[:, None].expand(-1, h, -1, -1)), dim=-1)  # [B, H, T, Dh]
        write_entries(per_head.kv[0], index, torch.stack((k, F.pad(v, (0, dh - cfg.v_head_dim)))))
        read = gather_blocks(per_head.kv[0], index.tables.reshape(-1)).view(2, h, 2, -1, dh)  # [2, H, B, J, Dh]
        out = F.scaled_dot_product_attention(torch.cat((q_nope, q_rot), -1), read[0].transpose(0, 1),
                                             read[1].transpose(0, 1), attn_mask=index.mask, scale=attn.scale)
        want = attn.o_proj(out[..., : cfg.v_head_dim].transpose(1, 2).reshape(2, n, -1))
        return got, want

    for start, n in ((0, 6), (6, 3), (9, 1), (10, 1)):  # prefill, verify-shaped, decode
        got, want = step(start, n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("speculate", [False, True])
def test_engine_greedy_equals_transformers_generate(tiny, speculate):
    """Prompts sharing a prefix (prefix-cache hits, with copy-on-write of the shared last block),
    decoded through the latent cache, with and without n-gram speculation (verify passes)."""
    folder, hf = tiny
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 96, (9,), generator=g).tolist()
    ps = [shared + torch.randint(2, 96, (n,), generator=g).tolist() * 2 for n in (2, 3, 4)]
    runner = ModelRunner(load_checkpoint(folder), max_num_seqs=4, max_model_len=64, block_size=4,
                         prefix_caching=True)
    engine = LLMEngine(runner, proposer=NgramProposer() if speculate else None,
                       spec=SpecConfig(num_tokens=3 if speculate else 0))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = engine.generate(ps[:1], params)  # its blocks stay cached for the others
    outs = first + engine.generate(ps[1:], params)
    for o, p in zip(outs, ps):
        assert o.token_ids == hf_greedy(hf, p, 10)
    assert runner.stats()["prefix_cache_hit_blocks"] >= 2 * 2  # the shared 9 tokens: 2 whole blocks, twice
    if speculate:
        assert engine.spec_metrics.num_draft_tokens > 0
