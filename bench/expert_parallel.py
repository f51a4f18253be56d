"""Expert parallelism on this machine: a decode step split into attention, gating, dispatch,
experts and combine for W = 1 and W = 2 shard processes, the all-to-all share of a step, and
decode throughput W = 2 vs W = 1 at a fixed batch; with --compile, each W also with every
rank's passes compiled between its collectives (model_shards/compiled_step.py); with --padded,
each W > 1 also with the all-to-all's padded layout (model_shards/all_to_all.py, the GPU's).

    python -m bench.expert_parallel [--checkpoint DIR] [--batch 16] [--steps 32] [--runs 5] [--worlds 1 2 4] [--compile] [--padded]

Runs alternate the configurations; run i of every configuration decodes the same prompts (seed
i), so ratios are taken per run and reported as the median of the per-run ratios with its
bootstrap interval (bench/timing.py); times are medians. The phase split is measured on rank 0;
with W = 2, dispatch and combine include waiting for the other rank (that is the cost). In a
compiled run attention and gating are inside the graphs, so they count as "other".
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import statistics  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.local_group import LocalShardGroup  # noqa: E402
from bench.report import environment, write  # noqa: E402
from bench.timing import format_ratio, ratio_over_rounds  # noqa: E402
from model_shards.moe import TIMER  # noqa: E402
from moeserve.engine import LLMEngine  # noqa: E402
from moeserve.engine.factory import demo_checkpoint  # noqa: E402
from moeserve.sampling_params import SamplingParams  # noqa: E402

PHASES = ["attention", "gating", "dispatch", "experts", "combine"]


def one_run(checkpoint: str, world: int, batch: int, steps: int, prompt_len: int, seed: int,
            compile: bool = False, padded: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 1000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    with LocalShardGroup(checkpoint, world, max_num_seqs=batch, max_model_len=prompt_len + steps + 8,
                         compile=compile, padded=padded) as runner:
        engine = LLMEngine(runner)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # prefill
        engine.step()  # warm-up decode
        TIMER.reset()
        TIMER.enabled = True
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            engine.step()
        elapsed = time.perf_counter() - t0
        TIMER.enabled = False
    per_step = {k: TIMER.totals.get(k, 0.0) / (steps - 1) * 1e3 for k in PHASES}
    step_ms = elapsed / (steps - 1) * 1e3
    per_step["other"] = max(0.0, step_ms - sum(per_step.values()))
    return {"world": world, "step_ms": step_ms, "tokens_per_s": batch * (steps - 1) / elapsed, "phases_ms": per_step}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default=demo_checkpoint("demo-moe"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    # every run starts each configuration's shard group afresh (its processes and, compiled, its
    # graphs), which costs far more than the timed steps: 5 runs give each ratio an interval while
    # the README's full command (--worlds 1 2 4 --compile) stays short enough to rerun
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 short runs each (a smoke run)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="shard counts (the first is the baseline)")
    ap.add_argument("--compile", action="store_true", help="each W also compiled (compiling is not timed)")
    ap.add_argument("--padded", action="store_true", help="each W > 1 also with the padded all-to-all layout")
    ap.add_argument("--name", default=None, help="report name (default: expert_parallel, or expert_parallel-quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.steps = 3, 8
    name = args.name or ("expert_parallel-quick" if args.quick else "expert_parallel")
    torch.set_num_threads(1)  # one core per rank: W = 2 uses both cores, W = 1 one of them
    configs = {f"W={w}": (w, False, False) for w in args.worlds}
    if args.compile:
        configs |= {f"W={w} compiled": (w, True, False) for w in args.worlds}
    if args.padded:
        configs |= {f"W={w} padded": (w, False, True) for w in args.worlds if w > 1}
    results: dict[str, list[dict]] = {config: [] for config in configs}
    for run in tqdm(range(args.runs), desc=f"runs ({', '.join(configs)} alternating)"):
        order = list(configs)[run % len(configs):] + list(configs)[: run % len(configs)]
        for config in order:
            world, compiled, padded = configs[config]
            results[config].append(one_run(args.checkpoint, world, args.batch, args.steps, args.prompt_len, run,
                                           compiled, padded))

    summary = {}
    for config, runs in results.items():
        summary[config] = {
            "step_ms": statistics.median([r["step_ms"] for r in runs]),
            "tokens_per_s": statistics.median([r["tokens_per_s"] for r in runs]),
            "phases_ms": {k: statistics.median([r["phases_ms"][k] for r in runs]) for k in PHASES + ["other"]},
        }
        a2a = summary[config]["phases_ms"]["dispatch"] + summary[config]["phases_ms"]["combine"]
        summary[config]["dispatch_combine_share"] = a2a / summary[config]["step_ms"]
    worlds, base = list(configs), next(iter(configs))
    def per_run(a: str, b: str):
        return ratio_over_rounds([r["tokens_per_s"] for r in results[a]], [r["tokens_per_s"] for r in results[b]])

    ratios = {f"{w}/{base}": per_run(w, base) for w in worlds[1:]}
    if args.compile:
        ratios |= {f"W={w} compiled/W={w}": per_run(f"W={w} compiled", f"W={w}") for w in args.worlds}
    if args.padded:
        ratios |= {f"W={w} padded/W={w}": per_run(f"W={w} padded", f"W={w}") for w in args.worlds if w > 1}

    fig, ax = plt.subplots(figsize=(6, 3.5))
    left = [0.0] * len(worlds)
    for phase in PHASES + ["other"]:
        vals = [summary[w]["phases_ms"][phase] for w in worlds]
        ax.barh(worlds, vals, left=left, label=phase)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel(f"ms per decode step (batch {args.batch})")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()

    lines = [
        "# Expert parallelism: decode step split and throughput\n",
        f"Checkpoint `{args.checkpoint.split('/')[-1]}`, batch {args.batch}, prompt {args.prompt_len} tokens, "
        f"{args.steps} decode steps, {args.runs} alternating runs (times: medians), 1 thread per rank. "
        "Ratios: the median of the per-run ratios of tokens/s (run i of every configuration decodes the same "
        "prompts), in brackets its 90% bootstrap interval over the runs.\n",
        "| phase (ms/step, rank 0) | " + " | ".join(worlds) + " |",
        "|---|" + "---|" * len(worlds),
    ]
    for phase in PHASES + ["other"]:
        lines.append(f"| {phase} | " + " | ".join(f"{summary[w]['phases_ms'][phase]:.2f}" for w in worlds) + " |")
    lines += [
        "| **step** | " + " | ".join(f"**{summary[w]['step_ms']:.2f}**" for w in worlds) + " |",
        "",
        "- dispatch + combine share of a step: " + ", ".join(
            f"{w} {summary[w]['dispatch_combine_share']:.1%}" for w in worlds)
        + " (with W > 1: the all-to-all and waiting for the other ranks)",
        "- decode throughput: " + ", ".join(f"{w} {summary[w]['tokens_per_s']:.0f} tokens/s" for w in worlds)
        + "; " + ", ".join(f"**{label} = {format_ratio(r)}**" for label, r in ratios.items()),
        "",
        f"![phases]({name}-phases.png)",
    ]
    args.checkpoint = args.checkpoint.split("/")[-1]
    data = {"environment": environment(1), "args": vars(args), "summary": summary,
            "ratios": ratios, "runs": results}
    paths = write(name, data, "\n".join(lines), {"phases": fig})
    print("\n".join(lines))
    print(f"report: {paths[1]}")


if __name__ == "__main__":
    main()
