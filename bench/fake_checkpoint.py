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
from model_shards.model import CausalLM

DTYPE = torch.bfloat16


def checkpoint_index(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor name of the HF checkpoint (per-expert layout) with its shape and dtype, read off
    the model built on `meta`: its parameter names are the checkpoint's (Mixtral's MoE block is
    `block_sparse_moe`, DeepSeek's shared expert `shared_experts`), its fused experts split per expert."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    mixtral = cfg.family == "mixtral"
    index = {}
    for name, p in model.named_parameters():
        m = loader._EXPERT_PARAM.match(name)
        if m is None:
            if mixtral:
                name = name.replace(".mlp.", ".block_sparse_moe.")
            index[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = tuple(p.shape)
            continue
        per_expert = loader._PER_EXPERT[1 if mixtral else 0]
        num, rows, cols = p.shape  # gate_up_proj [E, 2I, D] or down_proj [E, D, I]
        parts = zip(per_expert[:2], (rows // 2,) * 2) if m.group(2) == "gate_up_proj" else [(per_expert[2], rows)]
        for template, r in parts:
            for e in range(num):
                index[f"{m.group(1)}.{template.format(e=e)}"] = (r, cols)
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
