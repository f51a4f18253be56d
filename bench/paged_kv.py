"""Prefix caching on the paged KV cache (demo MoE, 1 torch thread).

    python -m bench.paged_kv [--rounds 9] [--quick]

32 chats behind one long system prompt, after one warm-up chat: time to first token with prefix
caching vs without (the same cache, reserved whole at start), replies compared. Rounds alternate
the variants with fresh engines, and the ratio is the median of the per-round ratios with its
bootstrap interval (bench/timing.py). Writes bench/reports/paged_kv.{json,md} (`--quick`:
paged_kv-quick.*).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench import report
from bench.timing import format_ratio, ratio_over_rounds
from moeserve.config import AppConfig
from moeserve.engine.factory import build_engine
from moeserve.sampling_params import SamplingParams
from moeserve.tokenizer import render_chat

SYSTEM = ("You are the order assistant of Crumb, a bakery chain with shops in Pune, Bengaluru and Mumbai. "
          "Answer briefly and politely. Prices are in rupees. Sourdough, rye, baguettes, croissants, muffins "
          "and cakes are baked every morning; orders placed before noon can be picked up the same afternoon. "
          "Delivery costs 49 rupees inside the city. Ask for the pickup time when it is missing. ") * 3
ASKS = ("Do you have rye bread today?", "What does a baguette cost?", "Is the mawa cake eggless?",
        "Can I order six croissants for tomorrow?", "Do you deliver to Koregaon Park?",
        "When do you open on Sunday?", "Is the sourdough vegan?", "I want two muffins, afternoon pickup.")


def engine(prefix_caching: bool, max_num_seqs: int):
    return build_engine(AppConfig.from_options(draft="none", prefix_caching=prefix_caching, max_num_seqs=max_num_seqs))


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


def shared_prompt(rounds: int, quick: bool) -> dict[str, Any]:
    """Fresh engines every round (a second round on the same engine would find every chat cached)."""
    n = 8 if quick else 32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[float]] = {"prefix_caching": [], "no_prefix_caching": []}
    replies: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        variants = (("prefix_caching", True), ("no_prefix_caching", False))
        for name, on in variants[r % 2:] + variants[: r % 2]:
            eng = engine(on, n)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a smoke run)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 9)
    torch.set_num_threads(1)
    shared = shared_prompt(args.rounds, args.quick)
    md = "\n".join([
        "# Prefix caching on the paged KV cache",
        "",
        "`python -m bench.paged_kv" + (" --quick`" if args.quick else "`") + f": demo MoE, 1 torch thread, "
        f"block size 16, {args.rounds} rounds alternating prefix caching on and off with fresh engines (the same "
        "cache, reserved whole at start); the ratio is the median of the per-round ratios with its 90% bootstrap "
        "interval over the rounds (TTFT: medians).",
        "",
        "| measure | without prefix caching | with | ratio |",
        "|---|---|---|---|",
        f"| mean TTFT, {shared['chats']} chats behind one system prompt ({shared['prompt_tokens']} prompt tokens), "
        f"warm | {shared['mean_ttft_s']['no_prefix_caching'] * 1e3:.0f} ms | "
        f"{shared['mean_ttft_s']['prefix_caching'] * 1e3:.0f} ms | {format_ratio(shared['speedup'], 1)} faster |",
        "",
        f"Replies identical with and without prefix caching: {shared['replies_identical']}.",
    ])
    print(md)
    data = {"environment": report.environment(threads=1), "setup": {"rounds": args.rounds, "quick": args.quick},
            "shared_prompt": shared}
    name = "paged_kv-quick" if args.quick else "paged_kv"
    for p in report.write(name, data, md):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
