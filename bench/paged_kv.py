"""Paged KV cache vs the slot cache, side by side in one run (demo MoE, 1 torch thread).

    python -m bench.paged_kv [--rounds 9] [--quick]

1. memory: KV bytes allocated and held vs the bytes of the tokens really live, on a mixed-length
   workload (held-out demo chats, 16-128 new tokens each), sampled every step;
2. capacity: how many of those sequences run at once inside a fixed KV budget (what 16 slots
   of max_model_len 1024 take): the slot cache fits 16, the paged cache as many as their blocks allow;
3. shared system prompt: 32 chats behind one long system prompt, after one warm-up chat; time
   to first token with prefix caching vs without (same paged cache), replies compared;
4. decode: tokens/s at batch 16, paged vs slots (same prompts, 64 new tokens, greedy, prefix
   caching off), both engines stepping in turn in one loop; then the same with the compiled
   step (`engine.compile`) over each cache.

1 and 2 are counts. 3 and 4 are timed: rounds alternate the variants, and each ratio is the
median of the per-round ratios with its bootstrap interval (bench/timing.py). Writes
bench/reports/paged_kv.{json,md} and paged_kv-memory.png (`--quick`: paged_kv-quick*).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from bench import report  # noqa: E402
from bench.timing import format_ratio, ratio_over_rounds  # noqa: E402
from demo.prompts import formulaic  # noqa: E402
from moeserve.engine.factory import EngineConfig, build_engine  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402
from moeserve.tokenizer import render_chat  # noqa: E402

SYSTEM = ("You are the order assistant of Crumb, a bakery chain with shops in Pune, Bengaluru and Mumbai. "
          "Answer briefly and politely. Prices are in rupees. Sourdough, rye, baguettes, croissants, muffins "
          "and cakes are baked every morning; orders placed before noon can be picked up the same afternoon. "
          "Delivery costs 49 rupees inside the city. Ask for the pickup time when it is missing. ") * 3
ASKS = ("Do you have rye bread today?", "What does a baguette cost?", "Is the mawa cake eggless?",
        "Can I order six croissants for tomorrow?", "Do you deliver to Koregaon Park?",
        "When do you open on Sunday?", "Is the sourdough vegan?", "I want two muffins, afternoon pickup.")


def engine(kv_cache: str, prefix_caching: bool = True, max_num_seqs: int = 16, budget: int = 0, compile: bool = False):
    cfg = EngineConfig(speculation="none", kv_cache=kv_cache, prefix_caching=prefix_caching,
                       max_num_seqs=max_num_seqs, kv_budget_tokens=budget, compile=compile)
    return build_engine(cfg)


def kv_bytes_per_token(eng) -> int:
    c = eng.runner.model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * eng.runner.model.lm_head.weight.element_size()


def run(eng, prompts: list[list[int]], params: list[SamplingParams], sample=None) -> dict[str, Any]:
    """Run to completion; per request: time to first token (s since submit) and its tokens."""
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if sample is not None:
            sample(eng)
    return {"seconds": time.perf_counter() - t0, "ttft": [first[r] for r in ids], "tokens": [tokens[r] for r in ids],
            "steps": steps}


def memory(quick: bool) -> dict[str, Any]:
    """Bytes allocated vs live, one workload through each cache."""
    prompts = formulaic(engine("slots").tokenizer, 12 if quick else 32)
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(max_tokens=int(torch.randint(16, 129, (1,), generator=g)), temperature=0.0,
                             ignore_eos=True) for _ in prompts]
    out = {}
    for kind in ("slots", "paged"):
        eng = engine(kind)
        per_token = kv_bytes_per_token(eng)
        trace: list[tuple[int, int, int]] = []  # per step: bytes of live tokens, held, allocated

        def sample(e, per_token=per_token, trace=trace, kind=kind):
            live = sum(s.num_tokens for s in e.scheduler.running) * per_token
            if kind == "paged":
                held = e.runner.stats()["kv_blocks_held"] * e.runner.block_size * per_token
            else:
                held = e.runner.cache.nbytes
            trace.append((live, held, e.runner.cache.nbytes))

        run(eng, prompts, params, sample)
        peak_live = max(t[0] for t in trace)
        out[kind] = {"peak_allocated_bytes": max(t[2] for t in trace), "peak_live_bytes": peak_live,
                     "peak_held_bytes": max(t[1] for t in trace),
                     "held_over_live_at_peak": max(t[1] for t in trace) / max(peak_live, 1), "trace": trace}
    return out


def capacity(quick: bool) -> dict[str, Any]:
    """Sequences running at once within the KV budget of 16 slots of max_model_len."""
    probe = engine("slots")
    budget = probe.scheduler.cfg.kv_budget  # 16 x (1024 + 0)
    prompts = formulaic(probe.tokenizer, 48 if quick else 160)
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(max_tokens=int(torch.randint(16, 129, (1,), generator=g)), temperature=0.0,
                             ignore_eos=True) for _ in prompts]
    eng = engine("paged", max_num_seqs=len(prompts), budget=budget)
    peak = {"running": 0}

    def sample(e):
        peak["running"] = max(peak["running"], len(e.scheduler.running))

    res = run(eng, prompts, params, sample)
    lengths = [len(p) + sp.max_tokens for p, sp in zip(prompts, params)]
    return {"budget_tokens": budget, "slots_fit": probe.scheduler.cfg.max_num_seqs, "paged_peak_running": peak["running"],
            "ratio": peak["running"] / probe.scheduler.cfg.max_num_seqs, "mean_final_length": statistics.mean(lengths),
            "preemptions": eng.scheduler.num_preemptions, "seconds": res["seconds"]}


def shared_prompt(rounds: int, quick: bool) -> dict[str, Any]:
    """Fresh engines every round (a second round on the same engine would find every chat cached)."""
    n = 8 if quick else 32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[float]] = {"prefix_caching": [], "no_prefix_caching": []}
    replies: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        variants = (("prefix_caching", True), ("no_prefix_caching", False))
        for name, on in variants[r % 2:] + variants[: r % 2]:
            eng = engine("paged", prefix_caching=on, max_num_seqs=n)
            chats = [render_chat(eng.tokenizer, [{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": ASKS[i % len(ASKS)] + f" (order {i})"}])
                     for i in range(n + 1)]
            ids = [eng.tokenizer.encode(c, add_special_tokens=False) for c in chats]
            run(eng, ids[:1], [params])  # warm-up: the system prompt enters the cache
            res = run(eng, ids[1:], [params] * n)
            rows[name].append(statistics.mean(res["ttft"]))
            replies[name] = res["tokens"]
            prompt_len = len(ids[1])
    return {"chats": n, "prompt_tokens": prompt_len, "all_rounds": rows,
            "mean_ttft_s": {k: statistics.median(v) for k, v in rows.items()},
            "speedup": ratio_over_rounds(rows["no_prefix_caching"], rows["prefix_caching"]),
            "replies_identical": replies["prefix_caching"] == replies["no_prefix_caching"]}


def decode(rounds: int, quick: bool, compile: bool = False) -> dict[str, Any]:
    """Both engines decode the same batch in one loop, one step each in turn, so machine noise
    hits both alike; decode seconds are summed per engine (prefill excluded). The engines are
    built once (with `compile`, each compiles its step once) and run one untimed round first;
    prefix caching is off, so a round finds nothing cached from the one before."""
    new = 32 if quick else 64
    prompts = formulaic(engine("slots").tokenizer, 16)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engines = {kind: engine(kind, prefix_caching=False, compile=compile) for kind in ("slots", "paged")}
    rates: dict[str, list[float]] = {"slots": [], "paged": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds + 1):
        order = list(engines)[r % 2:] + list(engines)[: r % 2]  # who steps first alternates by round
        seconds = dict.fromkeys(engines, 0.0)
        tokens: dict[str, dict[str, list[int]]] = {}
        for kind in order:
            eng = engines[kind]
            ids = [eng.add_request(p, params) for p in prompts]
            tokens[kind] = {rid: [] for rid in ids}
            for out in eng.step():  # the prefill
                tokens[kind][out.request_id] += out.new_token_ids
        while any(e.has_unfinished() for e in engines.values()):
            for kind in order:
                t0 = time.perf_counter()
                outs = engines[kind].step()
                seconds[kind] += time.perf_counter() - t0
                for out in outs:
                    tokens[kind][out.request_id] += out.new_token_ids
        if r == 0:  # the untimed round: first-use costs (allocation, lazy init) land here
            continue
        for kind in engines:
            rates[kind].append(16 * (new - 1) / seconds[kind])
            outputs[kind] = list(tokens[kind].values())
    return {"batch": 16, "new_tokens": new, "compiled": compile, "all_rounds": rates,
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "paged_over_slots": ratio_over_rounds(rates["paged"], rates["slots"]),
            "outputs_identical": outputs["slots"] == outputs["paged"]}


def figure(mem: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for kind, color in (("slots", "tab:red"), ("paged", "tab:blue")):
        trace = mem[kind]["trace"]
        ax.plot([t[1] / 2**20 for t in trace], label=f"{kind}: KV held", color=color)
    ax.plot([t[2] / 2**20 for t in mem["paged"]["trace"]], label="paged: KV allocated", color="tab:blue", ls=":")
    ax.plot([t[0] / 2**20 for t in mem["paged"]["trace"]], label="tokens live", color="black", ls="--")
    ax.set_xlabel("engine step")
    ax.set_ylabel("MiB")
    ax.set_title("KV memory held vs live tokens, mixed-length workload")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a smoke run)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 9)
    torch.set_num_threads(1)
    mem, cap = memory(args.quick), capacity(args.quick)
    shared, dec = shared_prompt(args.rounds, args.quick), decode(args.rounds, args.quick)
    dec_c = decode(args.rounds, args.quick, compile=True)
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    md = "\n".join([
        "# Paged KV cache vs slots",
        "",
        "`python -m bench.paged_kv" + (" --quick`" if args.quick else "`") + f": demo MoE, 1 torch thread, "
        "block size 16. The first three rows are counts (the same every run); the timed rows run "
        f"{args.rounds} rounds alternating the two sides, and their ratio is the median of the per-round ratios "
        "with its 90% bootstrap interval over the rounds (tokens/s and TTFT: medians). Like for like: the TTFT "
        "row runs the same paged cache with prefix caching on and off, fresh engines every round; the decode "
        "rows run both caches with prefix caching off, prefill excluded.",
        "",
        "| measure | slots | paged | ratio |",
        "|---|---|---|---|",
        f"| KV allocated at peak (same budget, {mb(mem['slots']['peak_allocated_bytes'])}) | "
        f"{mb(mem['slots']['peak_allocated_bytes'])} | {mb(mem['paged']['peak_allocated_bytes'])} | "
        f"{mem['slots']['peak_allocated_bytes'] / mem['paged']['peak_allocated_bytes']:.1f}x less (counted) |",
        f"| KV held at peak (tokens of the running sequences at peak: {mb(mem['paged']['peak_live_bytes'])}; "
        "shared prefix blocks count once when paged) | "
        f"{mb(mem['slots']['peak_held_bytes'])} | {mb(mem['paged']['peak_held_bytes'])} | "
        f"{mem['slots']['peak_held_bytes'] / mem['paged']['peak_held_bytes']:.1f}x less (counted) |",
        f"| sequences running at once in a budget of {cap['budget_tokens']} tokens (mean final length "
        f"{cap['mean_final_length']:.0f}) | {cap['slots_fit']} | {cap['paged_peak_running']} | "
        f"{cap['ratio']:.1f}x (counted) |",
        f"| mean TTFT, {shared['chats']} chats behind one system prompt ({shared['prompt_tokens']} prompt tokens), "
        f"warm | {shared['mean_ttft_s']['no_prefix_caching'] * 1e3:.0f} ms without prefix caching | "
        f"{shared['mean_ttft_s']['prefix_caching'] * 1e3:.0f} ms with | {format_ratio(shared['speedup'], 1)} "
        "faster |",
        f"| decode tokens/s, batch 16 | {dec['tokens_per_s']['slots']:.0f} | {dec['tokens_per_s']['paged']:.0f} | "
        f"{format_ratio(dec['paged_over_slots'])} |",
        f"| decode tokens/s, batch 16, compiled step | {dec_c['tokens_per_s']['slots']:.0f} | "
        f"{dec_c['tokens_per_s']['paged']:.0f} | {format_ratio(dec_c['paged_over_slots'])} |",
        "",
        f"Replies identical with and without prefix caching: {shared['replies_identical']}; greedy outputs identical "
        f"paged vs slots at batch 16: {dec['outputs_identical']} (compiled: {dec_c['outputs_identical']}).",
        "",
        "![memory](paged_kv" + ("-quick" if args.quick else "") + "-memory.png)",
    ])
    print(md)
    data = {"environment": report.environment(threads=1), "setup": {"rounds": args.rounds, "quick": args.quick},
            "memory": {k: {kk: vv for kk, vv in v.items() if kk != "trace"} for k, v in mem.items()},
            "capacity": cap, "shared_prompt": shared, "decode": dec, "decode_compiled": dec_c}
    name = "paged_kv-quick" if args.quick else "paged_kv"
    for p in report.write(name, data, md, {"memory": figure(mem)}):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
