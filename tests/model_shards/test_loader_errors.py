"""A checkpoint that cannot be loaded fails with an error naming the file, architecture or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_shards import CheckpointError, load_checkpoint
from tests.model_shards.hf_tiny import save_tiny


@pytest.fixture
def tiny(tmp_path):
    save_tiny("mixtral", tmp_path)
    return tmp_path


def test_missing_folder_and_files(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    (tiny / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(tiny)
    (tiny / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tiny)


def test_unknown_architecture_is_named(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_checkpoint(tiny)


def test_wrong_shape_and_missing_tensor_are_named(tiny):
    tensors = load_file(tiny / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \(3, 3\)"):
        load_checkpoint(tiny)
    del tensors[name]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        load_checkpoint(tiny)
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match="experts.2.w3"):
        load_checkpoint(tiny)
