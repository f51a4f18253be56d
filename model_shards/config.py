"""Model configuration read from a Hugging Face `config.json`.

One frozen dataclass covers every supported family (`from_hf` maps each family's field names onto
it): families differ only in a handful of switches, so one model class serves all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

QKNorm = Literal["none", "head", "full"]

# architecture name in config.json -> family key
ARCHITECTURES: dict[str, str] = {
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MODEL_TYPES = {v: v for v in ARCHITECTURES.values()}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as transformers computes it (`_compute_yarn_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_positions: int, source: str) -> YarnScaling:
        original = rope.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(f"{source}: rope_scaling.original_max_position_embeddings: missing (needed by 'yarn')")
        return cls(
            factor=float(rope.get("factor") or max_positions / original),
            original_max_position_embeddings=int(original),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)),
        )


def _as_list(v: Any) -> list:
    return [] if v is None else v if isinstance(v, list) else [v]


def _need(hf: dict[str, Any], name: str, source: str) -> Any:
    if hf.get(name) is None:
        raise ValueError(f"{source}: {name}: missing (required by {hf.get('architectures') or hf.get('model_type')})")
    return hf[name]


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense families, dense layers of MoE families)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None
    rope_scaling: YarnScaling | None = None
    # multi-head latent attention (DeepSeek-V3; kv_lora_rank == 0 means plain attention)
    q_lora_rank: int = 0  # 0: a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # mixture of experts (num_experts == 0 means a dense model)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    gate_style: str = "mixtral"
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE scales it by sigmoid(shared_expert_gate(x)); DeepSeek does not
    sparse_layers: tuple[bool, ...] = field(default=())
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in MODEL_TYPES:
            raise ValueError(f"family: unknown model family {self.family!r}; supported: {sorted(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"top_k: must be in [1, num_experts={self.num_experts}], got {self.top_k}")
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size: must be positive for a mixture-of-experts model")
        if self.is_mla:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name}: must be positive for latent attention, got {getattr(self, name)}")
        if len(self.sparse_layers) != self.num_layers:
            object.__setattr__(self, "sparse_layers", tuple(bool(self.num_experts) for _ in range(self.num_layers)))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions of a head that rotary embeddings turn (MLA: only the decoupled rope part)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """(parts, heads, dim) of one token's KV-cache entry in one layer: keys and values per kv
        head, or MLA's one compressed latent (kv_lora_rank + the rope part's key)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        hf = json.loads(path.read_text())
        # generation_config.json may list more end-of-sequence ids (e.g. an end-of-turn token)
        gen = path.parent / "generation_config.json"
        extra = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        if extra is not None:
            ids = _as_list(hf.get("eos_token_id")) + _as_list(extra)
            hf = hf | {"eos_token_id": [i for i in dict.fromkeys(ids) if i is not None]}
        return cls.from_hf(hf, source=str(path))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Map a Hugging Face config dict onto ModelConfig; raises on an unknown architecture."""
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        family = family or MODEL_TYPES.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"{source}: rope_scaling.rope_type: {rope_type!r} is not supported ('default', 'yarn')")
        rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            _need(hf, name, source)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        max_positions = hf.get("max_position_embeddings", 4096)
        common = dict(family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                      num_layers=hf["num_hidden_layers"], num_heads=num_heads,
                      num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
                      intermediate_size=hf.get("intermediate_size", 0), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                      rope_theta=float(rope_theta), max_position_embeddings=max_positions,
                      rope_scaling=None if rope_type == "default" else YarnScaling.from_hf(rope, max_positions, source),
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      eos_token_id=tuple(_as_list(hf.get("eos_token_id"))), bos_token_id=hf.get("bos_token_id"))
        n = common["num_layers"]
        if family == "deepseek_v3":
            return cls._deepseek_v3(hf, common, source)
        if family == "mixtral":
            return cls(**common, num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["intermediate_size"], gate_style="mixtral")
        if family in ("qwen2_moe", "qwen3_moe"):
            mlp_only = set(hf.get("mlp_only_layers") or [])
            step = hf.get("decoder_sparse_step") or 1
            num_experts = hf.get("num_experts", hf.get("num_local_experts", 0))
            qwen2 = family == "qwen2_moe"
            return cls(
                **common, attention_bias=qwen2 and hf.get("qkv_bias", True), qk_norm="none" if qwen2 else "head",
                num_experts=num_experts, top_k=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), gate_style="softmax_topk",
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
                sparse_layers=tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n)),
            )
        if family == "olmoe":
            return cls(
                **common, attention_bias=bool(hf.get("attention_bias", False)), qk_norm="full",
                clip_qkv=hf.get("clip_qkv"), num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                gate_style="softmax_topk",
            )
        # dense: llama, qwen2 (Qwen2 always has q/k/v biases)
        return cls(**common, attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)))

    @classmethod
    def _deepseek_v3(cls, hf: dict[str, Any], common: dict[str, Any], source: str) -> ModelConfig:
        need = lambda name: _need(hf, name, source)  # noqa: E731
        nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
        num_experts, dense = need("n_routed_experts"), hf.get("first_k_dense_replace") or 0
        return cls(
            **common | dict(num_kv_heads=common["num_heads"], head_dim=nope + rope,
                            intermediate_size=need("intermediate_size")),
            attention_bias=bool(hf.get("attention_bias", False)), q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
            v_head_dim=need("v_head_dim"), rope_interleave=bool(hf.get("rope_interleave", True)),
            num_experts=num_experts, top_k=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            gate_style="sigmoid_bias",
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            shared_expert_intermediate_size=need("moe_intermediate_size") * (hf.get("n_shared_experts") or 0),
            shared_expert_gated=False,
            sparse_layers=tuple(num_experts > 0 and i >= dense for i in range(common["num_layers"])),
        )
