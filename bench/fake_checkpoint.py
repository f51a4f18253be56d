"""A fake checkpoint of any shape: the tensor index of a Hugging Face checkpoint (names, shapes,
dtypes) read by the real loader (`model_shards.loader.load_checkpoint`) as empty `meta` tensors,
so a full-size model loads, streamed tensor by tensor as from safetensors, with no memory.
Only the safetensors reader is replaced (`FakeTensors`, the loader's `_Tensors` interface).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from unittest import mock

import torch

import model_shards.loader as loader
from model_shards.config import ModelConfig

DTYPE = torch.bfloat16


def checkpoint_index(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor name of the HF checkpoint (per-expert layout) with its shape and dtype."""
    d, kv, q = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    index = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
             "lm_head.weight": (cfg.vocab_size, d)}
    mixtral = cfg.family == "mixtral"
    experts = "block_sparse_moe.experts.{e}.{w}.weight" if mixtral else "mlp.experts.{e}.{w}_proj.weight"
    names = ("w1", "w3", "w2") if mixtral else ("gate", "up", "down")
    i = cfg.moe_intermediate_size
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}"
        index |= {f"{p}.self_attn.q_proj.weight": (q, d), f"{p}.self_attn.k_proj.weight": (kv, d),
                  f"{p}.self_attn.v_proj.weight": (kv, d), f"{p}.self_attn.o_proj.weight": (d, q),
                  f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,)}
        if cfg.qk_norm == "head":
            index |= {f"{p}.self_attn.q_norm.weight": (cfg.head_dim,), f"{p}.self_attn.k_norm.weight": (cfg.head_dim,)}
        gate = f"{p}.block_sparse_moe.gate.weight" if mixtral else f"{p}.mlp.gate.weight"
        index[gate] = (cfg.num_experts, d)
        for e in range(cfg.num_experts):
            for name, shape in zip(names, ((i, d), (i, d), (d, i))):
                index[f"{p}.{experts.format(e=e, w=name)}"] = shape
    return {name: (shape, DTYPE) for name, shape in index.items()}


class FakeTensors:
    """The loader's safetensors reader over a checkpoint index: each tensor read is an empty
    `meta` tensor of its shape and dtype (`loader._Tensors`'s interface)."""

    def __init__(self, index: dict) -> None:
        self.index, self.bytes_read = index, 0

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str, rows=None) -> torch.Tensor:
        shape, dtype = self.index[name]
        t = torch.empty(shape, dtype=dtype, device="meta")
        t = t if rows is None else t[list(rows)]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][0]

    def file(self, name: str) -> str:
        return "model.safetensors (fake index)"


def load_rank(hf: dict, experts: tuple[int, ...]) -> torch.nn.Module:
    """`load_checkpoint` of this rank's experts, in bf16 on `meta`, from the fake index."""
    cfg = ModelConfig.from_hf(hf, source="shape")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(hf))
        with mock.patch.object(loader, "_Tensors", lambda _: FakeTensors(checkpoint_index(cfg))):
            return loader.load_checkpoint(folder, DTYPE, experts=experts, device="meta")
