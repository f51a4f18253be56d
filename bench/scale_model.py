"""An expert-parallel cost model for MoE decode: what one step costs per GPU (or CPU rank),
split into attention, gating, experts, dispatch, combine and other; tokens/s per GPU, memory
per GPU, all-to-all bytes per layer; the best layout for a latency or throughput target; and
what a measured expert-load skew costs with and without the router's placement (EPLB).

    python -m bench.scale_model --model mixtral-8x7b --hardware h200 --gpus 8 --batch 64
    python -m bench.scale_model --model deepseek-v3 --hardware h100 --fp8 --best --max-tpot-ms 100
    python -m bench.scale_model --model mixtral-8x7b --hardware h200 --best latency --batch 1
    python -m bench.scale_model --model qwen3-30b-a3b --hardware h200 --gpus 4 --skew load.json
    python -m bench.scale_model --report      # docs/scaling.md: every check, the plots

Models: an HF `config.json` (a path, or a name in bench/shapes/: mixtral-8x7b, qwen3-30b-a3b,
deepseek-v3, Mixtral/Qwen-MoE/DeepSeek-V3 field names). Hardware: HARDWARE below, or "cpu"
(measured on this machine: bench/reports/scale_model_cpu.json, `--calibrate-cpu`).

The model is a roofline per component: each part of a step takes the longer of its bytes
over memory bandwidth and its FLOPs over compute, at the efficiencies the profile states; the
all-to-all takes a fixed latency plus its bytes over NVLink (to ranks in the same node) and
RDMA (to the others); the step is compute + communication. Two-batch overlap (SGLang's,
DeepSeek's) runs two half-batches, each with its own weight reads and all-to-all latency,
each one's communication in flight during the other's compute (`two_batch`). The slowest rank sets the step, so an expert-load skew (busiest rank
over the mean) multiplies the expert and dispatch terms. docs/scaling.md checks it against
this machine and against published figures, and lists where it misses.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from model_shards.config import ModelConfig

SHAPES = Path(__file__).resolve().parent / "shapes"
CPU_PROFILE = Path(__file__).resolve().parent / "reports" / "scale_model_cpu.json"
DOCS = Path(__file__).resolve().parent.parent / "docs"


# ---- what is modelled -------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """Parameter and KV counts of an MoE decoder (elements, not bytes)."""

    name: str
    hidden: int
    layers: int
    moe_layers: int
    experts: int
    top_k: int
    expert_params: int  # one routed expert of one layer
    shared_params: int  # shared experts of one MoE layer (0: none)
    dense_mlp_params: int  # the MLP of one dense layer
    attn_params: int  # attention of one layer
    kv_per_token: int  # cached elements per token per layer
    attn_flops_per_key: int  # attention FLOPs per query token per cached key per layer
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model") -> Shape:
        d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        moe_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        dense_layers = cfg.get("first_k_dense_replace", 0) + len(cfg.get("mlp_only_layers") or [])
        shared = cfg.get("n_shared_experts") or 0
        shared_params = 3 * d * moe_inter * shared + 3 * d * cfg.get("shared_expert_intermediate_size", 0)
        parts, kv_heads, dim = ModelConfig.from_hf(cfg, source=name).kv_entry  # the engine's cache entry
        if "kv_lora_rank" in cfg:  # multi-head latent attention (DeepSeek-V2/V3), weights absorbed at decode
            q_lora, kv_lora, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
            nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            attn = d * q_lora + q_lora * heads * (nope + rope) + d * (kv_lora + rope) + kv_lora * heads * (nope + v)
            attn += heads * v * d
            per_key = 2 * heads * (2 * kv_lora + rope)
        else:  # grouped-query attention
            attn = 2 * d * heads * dim + 2 * d * kv_heads * dim
            per_key = 4 * heads * dim
        kv = parts * kv_heads * dim
        return cls(name=name, hidden=d, layers=layers, moe_layers=layers - dense_layers, experts=experts,
                   top_k=cfg["num_experts_per_tok"], expert_params=3 * d * moe_inter, shared_params=shared_params,
                   dense_mlp_params=3 * d * cfg["intermediate_size"], attn_params=attn, kv_per_token=kv,
                   attn_flops_per_key=per_key, vocab=cfg["vocab_size"])

    @property
    def total_params(self) -> int:
        dense = (self.layers - self.moe_layers) * self.dense_mlp_params
        moe = self.moe_layers * (self.experts * self.expert_params + self.shared_params + self.hidden * self.experts)
        return self.layers * self.attn_params + dense + moe + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU rank) and its links. Bandwidths in GB/s, compute in TFLOP/s."""

    name: str
    hbm_gbps: float
    tflops: float  # dense bf16
    mem_gib: float
    nvlink_gbps: float  # per direction, achievable between two GPUs of a node
    rdma_gbps: float  # per GPU, to other nodes
    gpus_per_node: int
    a2a_latency_us: float  # fixed cost of one dispatch or combine
    hbm_eff: float = 0.8  # achievable fraction of hbm_gbps
    flop_eff: float = 0.5  # achievable fraction of tflops at decode-sized matmuls
    layer_overhead_us: float = 0.0  # per layer and step: kernel launches, Python (CPU: the bulk of a small step)
    fp8_speedup: float = 2.0  # FLOP/s of fp8 matmuls over bf16 (1: no fp8 units)


# Datasheet figures (dense bf16, SXM parts); NVLink as achieved by DeepEP-style kernels on H800 (~160 GB/s)
# and the full per-direction rate on H100/H200 (450 GB/s); one 400 Gb/s ConnectX-7 NIC per GPU.
HARDWARE = {
    "h100": Hardware("H100 SXM", 3350, 989, 80, 450, 50, 8, 25),
    "h200": Hardware("H200 SXM", 4800, 989, 141, 450, 50, 8, 25),
    "a100": Hardware("A100 SXM 80GB", 2039, 312, 80, 300, 25, 8, 25, fp8_speedup=1.0),
    "h800": Hardware("H800 SXM", 3350, 989, 80, 160, 50, 8, 25),
}


@dataclass(frozen=True)
class Layout:
    """How a model is spread: `gpus` ranks, experts over all of them (EP = gpus), attention
    data-parallel (each rank its own `batch` sequences) or tensor-parallel in groups of `tp`."""

    gpus: int = 8
    tp: int = 1  # attention tensor parallelism (1: data-parallel attention)
    batch: int = 64  # sequences per rank
    context: int = 2048  # cached tokens per sequence
    weight_bytes: float = 2.0  # 2: bf16, 1: fp8 weights
    kv_bytes: float = 2.0
    dispatch_bytes: float = 2.0  # per element sent to the experts (1: fp8 dispatch, as DeepEP)
    overlap: bool = False  # two-batch overlap: communication hidden behind the other half's compute
    skew: float = 1.0  # expert load of the busiest rank over the mean (1: perfectly balanced)
    redundant_experts: int = 0  # extra expert replicas over all ranks (EPLB)


# ---- the model ----------------------------------------------------------------------------------
def _roofline_ms(hw: Hardware, nbytes: float, *work: tuple[float, bool]) -> float:
    """The longer of `nbytes` over memory bandwidth and the FLOPs of `work`, each (flops, fp8)
    at its own precision's rate."""
    mem = nbytes / (hw.hbm_gbps * 1e9 * hw.hbm_eff)
    compute = sum(f / (hw.tflops * 1e12 * hw.flop_eff * (hw.fp8_speedup if fp8 else 1.0)) for f, fp8 in work)
    return max(mem, compute) * 1e3


def a2a_ms(hw: Hardware, nbytes: float, ranks: int) -> float:
    """One dispatch or combine moving `nbytes` from one rank: latency + NVLink and RDMA shares."""
    if ranks <= 1:
        return 0.0
    in_node = min(ranks, hw.gpus_per_node)
    intra, inter = (in_node - 1) / ranks, (ranks - in_node) / ranks
    return hw.a2a_latency_us / 1e3 + nbytes * (intra / (hw.nvlink_gbps * 1e9) + inter / (hw.rdma_gbps * 1e9)) * 1e3


def step(shape: Shape, hw: Hardware, lay: Layout) -> dict:
    """One decode step on the busiest rank: ms per component, tokens/s per GPU, memory, bytes."""
    if lay.overlap:
        return two_batch(shape, hw, lay)
    n, wb = lay.batch, lay.weight_bytes
    fp8 = wb <= 1.0
    ep = lay.gpus
    L, M = shape.layers, shape.moe_layers
    # attention: its weights (split over a TP group), this rank's KV cache, q.k and p.v
    kv_bytes = n * lay.context * shape.kv_per_token * lay.kv_bytes * L
    # the projections run at the weights' precision, q.k and p.v at the cache's: an fp8 model
    # with a bf16 KV cache (FlashMLA's decode kernel) gets no fp8 rate for the score FLOPs
    attention = _roofline_ms(hw, shape.attn_params * L * wb / lay.tp + kv_bytes,
                             (2 * n * L * shape.attn_params, fp8),
                             (n * L * shape.attn_flops_per_key * lay.context, lay.kv_bytes <= 1.0))
    if lay.tp > 1:  # all-reduce of the attention output in the TP group, over NVLink
        attention += L * (hw.a2a_latency_us / 1e3 + 2 * n * lay.tp * shape.hidden * 2 / (hw.nvlink_gbps * 1e9) * 1e3)
    gating = _roofline_ms(hw, M * shape.hidden * shape.experts * wb, (2 * n * M * shape.hidden * shape.experts, False))
    # routed experts: the busiest rank serves skew x its fair share of routes, reading each local
    # expert that gets at least one route
    routes = n * shape.top_k * lay.skew
    local = (shape.experts + lay.redundant_experts) / ep
    touched = local * (1 - math.exp(-routes / max(local, 1e-9)))
    experts = _roofline_ms(hw, M * touched * shape.expert_params * wb, (2 * M * routes * shape.expert_params, fp8))
    dense = (L - M) * shape.dense_mlp_params + M * shape.shared_params
    experts += _roofline_ms(hw, dense * wb, (2 * n * dense, fp8))  # shared experts and dense layers: every token
    # all-to-all: each route's hidden state out (dispatch) and its expert output back (combine, bf16)
    sent = n * shape.top_k * shape.hidden
    dispatch = M * a2a_ms(hw, sent * lay.dispatch_bytes * lay.skew, ep)
    combine = M * a2a_ms(hw, sent * 2.0 * lay.skew, ep)
    other = _roofline_ms(hw, shape.vocab * shape.hidden * wb, (2 * n * shape.vocab * shape.hidden, False))  # LM head
    other += L * hw.layer_overhead_us / 1e3
    total = attention + gating + experts + other + dispatch + combine
    weights = (L * shape.attn_params / lay.tp + (L - M) * shape.dense_mlp_params + M * shape.shared_params
               + M * shape.hidden * shape.experts + 2 * shape.vocab * shape.hidden
               + M * local * shape.expert_params) * wb
    return {
        "ms": {"attention": attention, "gating": gating, "experts": experts, "dispatch": dispatch,
               "combine": combine, "other": other},
        "step_ms": total,
        "tokens_per_s_per_gpu": n / total * 1e3,
        "memory_gib": {"weights": weights / 2**30, "kv": kv_bytes / 2**30},
        "a2a_bytes_per_layer": sent * (lay.dispatch_bytes + 2.0) * lay.skew if ep > 1 else 0.0,
        "experts_touched_per_layer": touched,
    }


def two_batch(shape: Shape, hw: Hardware, lay: Layout) -> dict:
    """The step with two-batch overlap, as SGLang and DeepSeek run it: the batch splits into two
    micro-batches that alternate on the GPU (attention 0, attention 1, experts 0, experts 1),
    each one's all-to-all in flight while the other computes, so a layer is four slots:
    attention 0 with combine 1 (of the layer before), attention 1 with dispatch 0, experts 0
    with dispatch 1, experts 1 with combine 0. Each half reads the weights again and pays its
    own all-to-all latency, which is why overlap loses at small batches."""
    whole = step(shape, hw, replace(lay, overlap=False))
    half = step(shape, hw, replace(lay, overlap=False, batch=lay.batch / 2))["ms"]
    attn, experts = half["attention"] + half["gating"], half["experts"]
    dispatch, combine = half["dispatch"], half["combine"]
    total = (max(attn, combine) + max(attn, dispatch) + max(experts, dispatch) + max(experts, combine)
             + 2 * half["other"])
    return {**whole, "ms": {k: 2 * v for k, v in half.items()}, "step_ms": total,
            "tokens_per_s_per_gpu": lay.batch / total * 1e3}


def fits(hw: Hardware, result: dict, headroom: float = 0.9) -> bool:
    """Whether a step's weights and KV cache (`step`'s result) fit in `headroom` of memory."""
    mem = result["memory_gib"]
    return mem["weights"] + mem["kv"] <= hw.mem_gib * headroom


def best_layout(shape: Shape, hw: Hardware, base: Layout, max_tpot_ms: float | None,
                gpus: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                objective: str = "throughput") -> tuple[Layout, dict] | None:
    """The layout with the most tokens/s per GPU whose step (time per output token) stays under
    max_tpot_ms (objective "throughput"), or the shortest step at the base layout's batch per GPU
    (objective "latency"); None: nothing fits. Searches ranks, attention TP and the batch per rank."""
    if objective == "latency":
        found = []
        for g in gpus:
            for tp in (1, 2, 4, 8):
                if g > max(shape.experts, 1) or tp > min(g, hw.gpus_per_node):
                    continue
                lay = replace(base, gpus=g, tp=tp)
                r = step(shape, hw, lay)
                if fits(hw, r):
                    found.append((r["step_ms"], g, tp, lay, r))
        if not found:
            return None
        return min(found, key=lambda f: f[:3])[3:]
    best = None
    for g in gpus:
        if g > max(shape.experts, 1):
            break
        for tp in (1, 2, 4, 8):
            if tp > g or tp > hw.gpus_per_node:
                continue
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
                lay = replace(base, gpus=g, tp=tp, batch=b)
                r = step(shape, hw, lay)
                if not fits(hw, r):
                    break
                if max_tpot_ms is not None and r["step_ms"] > max_tpot_ms:
                    break
                if best is None or r["tokens_per_s_per_gpu"] > best[1]["tokens_per_s_per_gpu"]:
                    best = (lay, r)
    return best


def skew_from_stats(stats: dict, ranks: int) -> dict[str, float]:
    """Busiest-rank load over the mean, averaged over layers, from expert-load counters (the
    body of GET /admin/experts, or an ExpertLoadStats dict): with experts split contiguously,
    and with the router's EPLB placement (one spare slot per rank for replicas)."""
    import torch

    from router_service.placement import balanced_placement, contiguous_placement

    counts = stats.get("route_counts") or stats.get("counters", {}).get("route_counts")
    load = torch.tensor(counts, dtype=torch.float64)  # [L, E]
    load = load[load.sum(dim=1) > 0]
    if not len(load):
        raise ValueError("the expert-load counters are empty: send traffic first")
    num_experts = load.shape[1]
    placements = {"contiguous": contiguous_placement(num_experts, ranks),
                  "eplb": balanced_placement(load, ranks, -(-num_experts // ranks) + 1)}
    out = {}
    for name, p in placements.items():
        ratios = [float(r.max() / r.mean()) for r in (p.rank_load(layer) for layer in load)]
        out[name] = sum(ratios) / len(ratios)
    return out


# ---- inputs -------------------------------------------------------------------------------------
def load_shape(name_or_path: str) -> Shape:
    path = Path(name_or_path)
    if not path.is_file():
        path = SHAPES / f"{name_or_path}.json"
    if not path.is_file():
        raise SystemExit(f"no model shape {name_or_path!r}: give a config.json or one of "
                         f"{sorted(p.stem for p in SHAPES.glob('*.json'))}")
    return Shape.from_hf(json.loads(path.read_text()), path.stem)


def load_hardware(name: str) -> Hardware:
    if name == "cpu":
        if not CPU_PROFILE.is_file():
            raise SystemExit("no CPU profile yet: run `python -m bench.scale_model --calibrate-cpu`")
        return Hardware(**json.loads(CPU_PROFILE.read_text())["hardware"])
    if name not in HARDWARE:
        raise SystemExit(f"hardware: one of {sorted(HARDWARE) + ['cpu']}, got {name!r}")
    return HARDWARE[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mixtral-8x7b", help="a config.json, or a name in bench/shapes/")
    ap.add_argument("--hardware", default="h200", help=f"{', '.join(HARDWARE)} or cpu")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1, help="attention tensor parallelism (1: data-parallel attention)")
    ap.add_argument("--batch", type=int, default=64, help="sequences per GPU")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--fp8", action="store_true", help="fp8 weights and dispatch (DeepSeek-V3's own format)")
    ap.add_argument("--overlap", action="store_true", help="two-batch overlap: two half-batches, communication behind compute")
    ap.add_argument("--skew", default=None, help="expert-load counters (JSON from GET /admin/experts)")
    ap.add_argument("--best", nargs="?", const="throughput", choices=["throughput", "latency"],
                    help="search the layout: most tokens/s per GPU (under --max-tpot-ms), or the "
                         "shortest step at --batch sequences per GPU")
    ap.add_argument("--max-tpot-ms", type=float, default=None, help="with --best: latency target per token")
    ap.add_argument("--calibrate-cpu", action="store_true", help="measure this machine's CPU profile")
    ap.add_argument("--report", action="store_true", help="write docs/scaling.md (checks and plots)")
    args = ap.parse_args(argv)
    if args.calibrate_cpu:
        from bench.scale_checks import calibrate_cpu

        calibrate_cpu()
        return 0
    if args.report:
        from bench.scale_report import write_report

        write_report()
        return 0
    shape, hw = load_shape(args.model), load_hardware(args.hardware)
    wb = 1.0 if args.fp8 else 2.0
    lay = Layout(gpus=args.gpus, tp=args.tp, batch=args.batch, context=args.context, weight_bytes=wb,
                 dispatch_bytes=wb, overlap=args.overlap)
    print(f"{shape.name}: {shape.total_params / 1e9:.1f} B parameters, {shape.experts} experts top-{shape.top_k}, "
          f"{shape.moe_layers}/{shape.layers} MoE layers; {hw.name}")
    if args.skew:
        skews = skew_from_stats(json.loads(Path(args.skew).read_text()), args.gpus)
        for name, s in skews.items():
            r = step(shape, hw, replace(lay, skew=s))
            print(f"  skew with {name} placement: {s:.2f} -> {r['step_ms']:.2f} ms/step, "
                  f"{r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU")
    if args.best:
        found = best_layout(shape, hw, lay, args.max_tpot_ms, objective=args.best)
        if found is None:
            print("  nothing fits (memory or the latency target)")
            return 1
        lay = found[0]
        print(f"  best: {lay.gpus} GPUs, attention TP {lay.tp}, batch {lay.batch} per GPU")
    r = step(shape, hw, lay)
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r["ms"].items()) + " (ms)")
    print(f"  step {r['step_ms']:.2f} ms -> {r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU; memory per GPU: "
          f"weights {r['memory_gib']['weights']:.1f} GiB, KV {r['memory_gib']['kv']:.1f} GiB; "
          f"all-to-all {r['a2a_bytes_per_layer'] / 2**20:.2f} MiB per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
