"""Decode on a GPU against the memory-bandwidth roofline: a Mixtral-8x7B-shaped model with
random bf16 weights (layers reduced to fit one GPU), batch 1 and 64, eager and compiled.

A decode step has to read every weight it uses once: the dense part of each layer, the
experts its tokens are routed to (2 of 8 for one token; nearly all 8 for 64), the LM head and
the KV cache of every row. At batch 1 that is memory-bound by far, so the floor of a step is
those bytes over the HBM bandwidth; the report gives tokens/s, the step time, that floor and
the fraction of it reached (expert coverage as measured by the router in the timed steps).

    python -m bench.gpu                      # on a GPU machine: one command, a few minutes
    python -m bench.gpu --layers 16 --context 2048 --hbm-tbps 4.8
    python -m bench.gpu --smoke              # a tiny shape on the CPU: checks the script runs
    python -m bench.gpu --dry-run --model qwen3-30b-a3b --gpus 8   # full size on `meta`, no GPU (bench/dry_run.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench import report
from model_shards.config import ModelConfig
from model_shards.loader import empty_model
from moeserve.engine.model_runner import ModelRunner, Row

SHAPES = Path(__file__).resolve().parent / "shapes"
# HBM bandwidth (TB/s) by the name torch reports; --hbm-tbps overrides
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.86}
SMOKE_SHAPE = {"architectures": ["MixtralForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 1024}


def build(shape: dict, layers: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model with random weights (std 0.02, like an untrained init), built on `device`."""
    cfg = ModelConfig.from_hf({**shape, "num_hidden_layers": layers}, source="shape")
    model = empty_model(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def bytes_per_step(model, batch: int, context: int, experts_touched: float) -> dict[str, float]:
    """What one decode step must read: dense weights, the experts touched per layer, KV cache."""
    cfg = model.config
    size = next(model.parameters()).element_size()
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) / max(cfg.num_layers, 1)
    expert /= max(cfg.num_experts, 1)  # one expert of one layer
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    dense -= model.model.embed_tokens.weight.numel()  # only `batch` rows of the embedding are read
    parts, heads, dim = cfg.kv_entry
    kv = batch * context * cfg.num_layers * parts * heads * dim
    return {"dense": dense * size, "experts": expert * experts_touched * cfg.num_layers * size, "kv": kv * size}


def decode(runner: ModelRunner, batch: int, context: int, steps: int, warmup: int) -> dict[str, float]:
    """Prefill `batch` random prompts of `context` tokens, then time `steps` greedy decode steps."""
    vocab, sync = runner.vocab_size, runner.device.type == "cuda"
    ids = [f"s{i}" for i in range(batch)]
    for sid in ids:
        runner.add(sid)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
    logits = torch.cat([runner.forward([Row(sid, p, 0)]) for sid, p in zip(ids, prompts)])
    pos = context
    stats = runner.model.moe_blocks[0].stats  # the router's counters: which experts each step used
    times, touched = [], []
    for _ in range(warmup + steps):
        tokens = logits.argmax(-1).tolist()
        before = stats.route_counts.clone()
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = runner.forward([Row(sid, [t], pos) for sid, t in zip(ids, tokens)])  # returns on the CPU: synced
        times.append(time.perf_counter() - t0)
        touched.append(float(((stats.route_counts - before) > 0).sum(dim=1).float().mean()))  # per layer
        pos += 1
    for sid in ids:
        runner.remove(sid)
    step = statistics.median(times[warmup:])
    return {"step_ms": step * 1e3, "tokens_per_s": batch / step, "experts_touched": statistics.mean(touched[warmup:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=str(SHAPES / "mixtral-8x7b.json"), help="an HF config.json")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (Mixtral has 32: 8 fit one GPU with room)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=None,
                    help="tokens cached per row before decoding (default 512; --dry-run: 2048, its KV budget per row)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (compiles the graphs it needs)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="memory bandwidth (default: by GPU name)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, a few steps")
    ap.add_argument("--name", default=None, help="report name (default: gpu, or gpu-smoke)")
    ap.add_argument("--dry-run", action="store_true", help="the full model on `meta`: devices, dtypes, host syncs, memory")
    ap.add_argument("--model", default="mixtral-8x7b", help="with --dry-run: mixtral-8x7b, qwen3-30b-a3b or deepseek-v3")
    ap.add_argument("--gpus", type=int, default=8, help="with --dry-run: ranks of the layout (experts split over them)")
    ap.add_argument("--batch", type=int, default=64, help="with --dry-run: sequences per GPU (the KV budget)")
    ap.add_argument("--dry-run-layers", type=int, default=None,
                    help="with --dry-run: only the first N decoder layers (full width; faster, compiled above all)")
    args = ap.parse_args(argv)
    if args.dry_run:
        from bench import dry_run

        compiled = not args.no_compile
        print(dry_run.report(dry_run.dry_run(args.model, args.gpus, args.batch, args.context or 2048,
                                             compiled=compiled, layers=args.dry_run_layers)))
        return 0
    args.context = args.context or 512
    from model_shards.device import resolve_device, resolve_dtype

    shape = json.loads(Path(args.shape).read_text())
    if args.smoke:
        shape, args.layers, args.device, args.context, args.steps, args.warmup = SMOKE_SHAPE, 2, "cpu", 32, 3, 1
        args.batches = [1, 4]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in gpu), None)

    label = "smoke" if args.smoke else Path(args.shape).stem
    model = build(shape, args.layers, device, dtype)
    model.enable_stats()
    params = sum(p.numel() for p in model.parameters())
    print(f"{gpu}: {args.layers} layers of {label}, "
          f"{params / 1e9:.2f} B parameters in {dtype} ({params * next(model.parameters()).element_size() / 2**30:.1f} GiB)")
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    rows, results = [], []
    for mode in modes:
        t0 = time.perf_counter()
        runner = ModelRunner(model, max(args.batches), args.context + args.warmup + args.steps + 1,
                             prefix_caching=False, compile=mode == "compiled")
        for b in args.batches:
            r = decode(runner, b, args.context, args.steps, args.warmup)
            need = bytes_per_step(model, b, args.context, r["experts_touched"])
            total = sum(need.values())
            floor_ms = total / (tbps * 1e12) * 1e3 if tbps else None
            r |= {"mode": mode, "batch": b, "bytes_per_step": need, "roofline_ms": floor_ms,
                  "of_roofline": floor_ms / r["step_ms"] if floor_ms else None}
            results.append(r)
            rows.append([mode, b, r["tokens_per_s"], r["step_ms"], r["experts_touched"], total / 2**30,
                         floor_ms if floor_ms is not None else "n/a",
                         f"{r['of_roofline']:.0%}" if floor_ms else "n/a"])
            print(f"{mode:9s} batch {b:3d}: {r['tokens_per_s']:9.1f} tok/s, {r['step_ms']:.2f} ms/step"
                  + (f", roofline {floor_ms:.2f} ms ({r['of_roofline']:.0%})" if floor_ms else ""))
        print(f"{mode}: {time.perf_counter() - t0:.1f} s including compiling")
    header = ["mode", "batch", "tokens/s", "ms/step", "experts/layer", "GiB read/step", "roofline ms", "of roofline"]
    md = (f"# Decode on {gpu}\n\n{args.layers} layers of the {label} shape, random {dtype} weights, "
          f"{args.context} tokens cached per row, median of {args.steps} steps. Roofline: the bytes a step must read "
          f"(dense weights, the experts its tokens touched, the KV cache) over {tbps} TB/s.\n\n"
          + report.markdown_table(header, rows))
    report.write(args.name or ("gpu-smoke" if args.smoke else "gpu"),
                 {"gpu": gpu, "hbm_tbps": tbps, "setup": report.portable(vars(args)), "results": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
