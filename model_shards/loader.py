"""Load a Hugging Face checkpoint (config.json + safetensors, single file or sharded with an
index) into `CausalLM`, reading only the experts this process holds.

Expert tensors come in two layouts found in the wild, both accepted (DeepSeek-V3's per-expert
names are Qwen's):
  fused       `...mlp.experts.gate_up_proj` [E, 2I, D] and `...mlp.experts.down_proj` [E, D, I]
  per-expert  `...mlp.experts.N.{gate,up,down}_proj.weight` (Qwen/OLMoE) or
              `...block_sparse_moe.experts.N.{w1,w3,w2}.weight` (Mixtral)
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from model_shards.config import ModelConfig
from model_shards.model import CausalLM
from model_shards.moe import LocalExperts

_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# per-expert names: (gate, up, down) for each naming scheme
_PER_EXPERT = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file, architecture or tensor."""


class _Tensors:
    """Name -> file lookup over the checkpoint's safetensors files, opened lazily."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: folder / f for name, f in weight_map.items()}
        elif single.is_file():
            with safe_open(single, "pt") as f:
                self.where = {name: single for name in f.keys()}  # noqa: SIM118
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        for f in set(self.where.values()):
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the index but missing")
        self._open: dict[Path, object] = {}
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _handle(self, name: str):
        f = self.where[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "pt")
        return self._open[f]

    def get(self, name: str, rows: Sequence[int] | None = None) -> torch.Tensor:
        """The tensor, or only the given rows of its first dimension (for fused experts)."""
        h = self._handle(name)
        if rows is None:
            t = h.get_tensor(name)
        else:
            s = h.get_slice(name)
            t = torch.stack([s[r] for r in rows])
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def file(self, name: str) -> str:
        return self.where[name].name


def _first_present(tensors: _Tensors, names: Sequence[str]) -> str | None:
    return next((n for n in names if n in tensors), None)


def _load_experts(tensors: _Tensors, prefix: str, which: str, experts: Sequence[int]) -> torch.Tensor:
    fused = _first_present(tensors, [f"{prefix}.mlp.experts.{which}", f"{prefix}.block_sparse_moe.experts.{which}"])
    if fused is not None:
        return tensors.get(fused, rows=experts)
    for gate, up, down in _PER_EXPERT:
        if f"{prefix}.{gate.format(e=experts[0])}" not in tensors:
            continue
        def one(template: str, e: int) -> torch.Tensor:
            name = f"{prefix}.{template.format(e=e)}"
            if name not in tensors:
                raise CheckpointError(f"missing tensor {name}")
            return tensors.get(name)
        if which == "down_proj":
            return torch.stack([one(down, e) for e in experts])  # [El, D, I]
        return torch.stack([torch.cat([one(gate, e), one(up, e)]) for e in experts])  # [El, 2I, D]
    raise CheckpointError(f"missing expert tensors for {prefix}.mlp.experts ({which}) in either layout")


def empty_model(cfg: ModelConfig, experts: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> CausalLM:
    """A `CausalLM` of this shape with uninitialised weights allocated on `device` in `dtype`
    (never materialised anywhere else first)."""
    with torch.device("meta"):
        model = CausalLM(cfg, experts)
    device = torch.device(device)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    with device:
        model.model.rotary.__init__(cfg)  # non-persistent buffer lost by to_empty
    return model.to(dtype)


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, *, experts: Sequence[int] | None = None,
                    device: str | torch.device = "cpu") -> CausalLM:
    """Load the checkpoint folder `path` into a `CausalLM` in `dtype` on `device`.

    `experts`: the global expert ids this process holds (default: all); other experts' tensors
    are never read (`model.loaded_bytes`: what was). Each tensor is copied into weights already
    on `device`, so a GPU model never needs a full copy in host memory.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    cfg = ModelConfig.from_file(folder)
    tensors = _Tensors(folder)
    local = tuple(range(cfg.num_experts)) if experts is None else tuple(int(e) for e in experts)
    bad = [e for e in local if not 0 <= e < max(cfg.num_experts, 1)]
    if bad:
        raise CheckpointError(f"experts {bad} out of range for a model with {cfg.num_experts} experts")
    model = empty_model(cfg, local, dtype, device)
    for name, param in model.named_parameters(remove_duplicate=True):
        m = _EXPERT_PARAM.match(name)
        if m:
            value = _load_experts(tensors, m.group(1), m.group(2), local)
            src = f"{name} (experts {list(local)})"
        else:
            # Mixtral's MoE block is `block_sparse_moe`; DeepSeek's shared expert `shared_experts`
            alts = (name.replace(".mlp.", ".block_sparse_moe."), name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
            found = _first_present(tensors, [name, *alts])
            if found is None:
                raise CheckpointError(f"{folder}: missing tensor {name}")
            value, src = tensors.get(found), f"{found} in {tensors.file(found)}"
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{folder}: tensor {src} has shape {tuple(value.shape)}, expected "
                                  f"{tuple(param.shape)} for architecture {cfg.family}")
        with torch.no_grad():
            param.copy_(value)  # casts to dtype, copies to device
    model.loaded_bytes = tensors.bytes_read
    model.source = folder  # where reload_experts reads from
    return model.eval()


def reload_experts(model: CausalLM, experts: Sequence[int]) -> int:
    """Make `model` hold exactly `experts` (global ids, in local slot order) in every MoE layer,
    reading from its checkpoint only the experts it does not hold yet; returns the bytes read."""
    folder = getattr(model, "source", None)
    if folder is None:
        raise CheckpointError("the model was not loaded from a checkpoint folder; cannot reload its experts")
    cfg = model.config
    local = tuple(int(e) for e in experts)
    if not local or any(not 0 <= e < cfg.num_experts for e in local):
        raise CheckpointError(f"experts {list(local)}: need one or more ids in [0, {cfg.num_experts})")
    tensors = _Tensors(folder)
    for name, old in list(model.named_modules()):
        if not isinstance(old, LocalExperts):
            continue
        if old.expert_ids == local:
            continue
        prefix, _, attr = name.rpartition(".")
        with torch.device("meta"):
            new = LocalExperts(local, old.down_proj.shape[1], old.down_proj.shape[2])
        new = new.to_empty(device=old.down_proj.device).to(old.down_proj.dtype)
        layer = prefix.rsplit(".mlp", 1)[0]
        held = {e: j for j, e in enumerate(old.expert_ids)}
        read = [e for e in local if e not in held]
        with torch.no_grad():
            for which in ("gate_up_proj", "down_proj"):
                fresh = dict(zip(read, _load_experts(tensors, layer, which, read))) if read else {}
                current = getattr(old, which)
                for j, e in enumerate(local):
                    getattr(new, which)[j].copy_(current[held[e]] if e in held else fresh[e])
        setattr(model.get_submodule(prefix), attr, new.eval())
    return tensors.bytes_read
