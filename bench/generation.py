"""Issue 2 harness: our in-process generation against transformers `generate`.

Same checkpoint, prompts and token counts (greedy, EOS ignored so every run writes the same
number of tokens): batch 1 (prompts one after another) and one batch of B prompts; plus
transformers' assisted generation with the demo draft (batch 1, its only mode). Like for like:
every run of every case prefills each prompt in full (our prefix cache is off; transformers
keeps no cache between calls). Runs are interleaved round by round; tokens/s are medians,
ratios the median of per-round ratios with a 90% bootstrap interval over the rounds.

A separately labelled pair of cases runs our compiled engine with its prefix cache on: the same
prompts come back every round, so it prefills only each prompt's last part-block. Those rows
show what the cache is worth on a repeated prompt; they are not in the like-for-like ratios.

    python -m bench.generation [--quick] [--rounds R] [--batch B] [--new-tokens N]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from bench import report, workloads  # noqa: E402
from bench.timing import format_ratio, interleaved, paired, summarize  # noqa: E402
from demo.prompts import formulaic  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.engine import LLMEngine, SchedulerConfig  # noqa: E402
from moeserve.engine.factory import demo_checkpoint  # noqa: E402
from moeserve.engine.model_runner import ModelRunner  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402

WARM = "prefix cache warm"  # the label of every case that is not like for like

SIDES = [
    "**ours**: our engine (`LLMEngine`) on its default cache, paged in 16-token blocks, with prefix caching "
    "**off**, so every run prefills each prompt in full; eager, or \"compiled\" (decode passes as one "
    "`torch.compile`d graph, model_shards/compiled_step.py; prefill stays eager).",
    "**transformers**: `generate` with its default dynamic cache, which lives for one call: every run "
    "recomputes every prompt. \"static+compile\": its static cache and a `torch.compile`d forward "
    "(transformers' own recipe for fast generation). \"+ assistant\": assisted generation with the demo draft.",
    f"**ours compiled, {WARM}** (separate rows, not like for like): prefix caching on, and the same prompts "
    "every round, so after the first run each prompt's full blocks come from the cache and only its last "
    "part-block is prefilled. What the cache is worth on a repeated prompt; not in the ratios above it.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.generation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts-b1", type=int, default=4, help="prompts in the batch-1 workload")
    ap.add_argument("--num-assistant-tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--target", default=demo_checkpoint("demo-moe"))
    ap.add_argument("--draft", default=demo_checkpoint("demo-draft"))
    ap.add_argument("--name", default=None, help="report name (default: generation, or generation-quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.new_tokens, args.prompts_b1 = 3, 4, 24, 2
    torch.set_num_threads(args.threads)
    env = report.environment(args.threads)

    tokenizer = load_tokenizer(args.target)
    prompts = formulaic(tokenizer, max(args.batch, args.prompts_b1))
    b1_prompts, batch_prompts = prompts[: args.prompts_b1], prompts[: args.batch]

    compile_s: list[float] = []

    def our_engine(compile: bool, prefix_caching: bool = False) -> LLMEngine:
        runner = ModelRunner(load_checkpoint(args.target), args.batch, 1024, prefix_caching=prefix_caching,
                             compile=compile)
        if compile:  # with prefix caching, a prefill after a hit is a short multi-position pass: its graph too
            compile_s.append(runner.compiled.warm_up((1, 2) if prefix_caching else (1,)))
        return LLMEngine(runner, tokenizer, scheduler=SchedulerConfig(
            args.batch, 1 << 16, 1024, block_size=16, share_prefill=prefix_caching))

    engine, compiled, warm = our_engine(False), our_engine(True), our_engine(True, prefix_caching=True)
    hf_target = workloads.load_hf(args.target)
    hf_draft = workloads.load_hf(args.draft, args.num_assistant_tokens)
    hf_compiled = workloads.load_hf(args.target, compiled=True)

    # The same tokens on both sides first (our model equals transformers' on this checkpoint); the
    # warm engine twice, so that its second pass reads every prompt's full blocks from its cache.
    reference = [workloads.hf_generate(hf_target, [p], args.new_tokens)[0] for p in batch_prompts]
    identical = {
        "ours eager": workloads.ours_outputs(engine, batch_prompts, args.new_tokens) == reference,
        "ours compiled": workloads.ours_outputs(compiled, batch_prompts, args.new_tokens) == reference,
        f"ours compiled, {WARM}": all(workloads.ours_outputs(warm, batch_prompts, args.new_tokens) == reference
                                      for _ in range(2)),
        "transformers static+compile (batch 1 prompts)": [
            workloads.hf_generate(hf_compiled, [p], args.new_tokens)[0] for p in b1_prompts
        ] == reference[: len(b1_prompts)],
    }
    n, bb = args.new_tokens, f"b{args.batch}"
    cases = {
        "ours b1": workloads.ours(engine, b1_prompts, n, 1),
        "ours compiled b1": workloads.ours(compiled, b1_prompts, n, 1),
        "transformers b1": workloads.hf(hf_target, b1_prompts, n, 1),
        "transformers + assistant b1": workloads.hf(hf_target, b1_prompts, n, 1, assistant=hf_draft),
        "transformers static+compile b1": workloads.hf(hf_compiled, b1_prompts, n, 1),
        f"ours {bb}": workloads.ours(engine, batch_prompts, n, args.batch),
        f"ours compiled {bb}": workloads.ours(compiled, batch_prompts, n, args.batch),
        f"transformers {bb}": workloads.hf(hf_target, batch_prompts, n, args.batch),
        f"transformers static+compile {bb}": workloads.hf(hf_compiled, batch_prompts, n, args.batch),
        f"ours compiled b1, {WARM}": workloads.ours(warm, b1_prompts, n, 1),
        f"ours compiled {bb}, {WARM}": workloads.ours(warm, batch_prompts, n, args.batch),
    }
    runs = interleaved(cases, args.rounds, desc="generation")
    summary = summarize(runs)
    pairs = {
        "ours / transformers, batch 1": ("ours b1", "transformers b1"),
        f"ours / transformers, batch {args.batch}": (f"ours {bb}", f"transformers {bb}"),
        "ours compiled / transformers, batch 1": ("ours compiled b1", "transformers b1"),
        f"ours compiled / transformers, batch {args.batch}": (f"ours compiled {bb}", f"transformers {bb}"),
        "ours compiled / transformers static+compile, batch 1": ("ours compiled b1", "transformers static+compile b1"),
        f"ours compiled / transformers static+compile, batch {args.batch}": (
            f"ours compiled {bb}", f"transformers static+compile {bb}"),
        "ours compiled / ours eager, batch 1": ("ours compiled b1", "ours b1"),
        f"ours compiled / ours eager, batch {args.batch}": (f"ours compiled {bb}", f"ours {bb}"),
        "transformers + assistant / transformers, batch 1": ("transformers + assistant b1", "transformers b1"),
        "ours / transformers + assistant, batch 1": ("ours b1", "transformers + assistant b1"),
    }
    warm_pairs = {
        f"ours compiled, {WARM} / transformers, batch 1": (f"ours compiled b1, {WARM}", "transformers b1"),
        f"ours compiled, {WARM} / transformers, batch {args.batch}": (
            f"ours compiled {bb}, {WARM}", f"transformers {bb}"),
        f"ours compiled, {WARM} / ours compiled, batch 1": (f"ours compiled b1, {WARM}", "ours compiled b1"),
        f"ours compiled, {WARM} / ours compiled, batch {args.batch}": (
            f"ours compiled {bb}, {WARM}", f"ours compiled {bb}"),
    }
    ratios = {label: paired(runs, a, b) for label, (a, b) in pairs.items()}
    warm_ratios = {label: paired(runs, a, b) for label, (a, b) in warm_pairs.items()}

    for name, row in summary.items():
        print(f"{name:42s} {row['median_tokens_per_s']:8.1f} tokens/s  (min {row['min_tokens_per_s']:.1f}, "
              f"max {row['max_tokens_per_s']:.1f}, {row['runs']} runs)")
    for name, value in (ratios | warm_ratios).items():
        print(f"{name:64s} {format_ratio(value)}")
    print(f"greedy tokens identical to transformers: {identical}; compiling the decode step took {compile_s[0]:.1f} s")

    name = args.name or ("generation-quick" if args.quick else "generation")
    setup = report.portable({k: v for k, v in vars(args).items() if k != "name"})
    data = {"bench": "generation", "setup": setup, "environment": env, "tokens_identical": identical,
            "compile_seconds": compile_s[0], "sides": SIDES, "summary": summary, "ratios": ratios,
            "not_like_for_like_ratios": warm_ratios}
    md = [
        "# Generation: ours vs transformers `generate`",
        "",
        f"`python -m bench.generation{' --quick' if args.quick else ''}`. Demo MoE target, greedy, {n} new tokens "
        f"per prompt (EOS ignored on both sides), batch 1 = {args.prompts_b1} held-out chat prompts one after "
        f"another, batch {args.batch} = one batch; assisted generation with the demo draft "
        f"({args.num_assistant_tokens} tokens per step, constant). {args.rounds} interleaved rounds after one "
        f"untimed warm-up each. torch threads: {args.threads}; load average at start: "
        f"{env['load_average_at_start'][0]:.1f} on {env['cpu_count']} cores. What each side does:",
        "",
        *[f"- {s}" for s in SIDES],
        "",
        report.markdown_table(
            ["case", "median tokens/s", "min", "max"],
            [[k, v["median_tokens_per_s"], v["min_tokens_per_s"], v["max_tokens_per_s"]] for k, v in summary.items()],
        ),
        "",
        "Ratios: the median of the per-round ratios of tokens/s, in brackets its 90% bootstrap interval over the "
        f"{args.rounds} rounds. (Dividing two medians of the table above pairs different rounds and can differ; "
        "it is not the measure.)",
        "",
        report.markdown_table(["ratio, like for like (every prompt prefilled in full)", "x [90% interval]"],
                              [[k, v] for k, v in ratios.items()]),
        "",
        report.markdown_table([f"not like for like: ours with the {WARM}", "x [90% interval]"],
                              [[k, v] for k, v in warm_ratios.items()]),
        "",
        f"Greedy tokens identical to transformers' on all {len(batch_prompts)} prompts: "
        + ", ".join(f"{k} **{v}**" for k, v in identical.items())
        + f". Compiling the decode step took {compile_s[0]:.1f} s in this run "
        "(inductor's on-disk cache makes a restart cheaper).",
        "",
        f"![tokens/s]({name}-throughput.png)",
    ]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(summary)
    med = [summary[k]["median_tokens_per_s"] for k in names]
    err = [[m - summary[k]["min_tokens_per_s"] for k, m in zip(names, med)],
           [summary[k]["max_tokens_per_s"] - m for k, m in zip(names, med)]]
    colors = ["C2" if WARM in k else "C0" if k.startswith("ours") else "C1" for k in names]
    ax.barh(names, med, xerr=err, color=colors)
    ax.set_xlabel("tokens/s (median, min-max); green: prefix cache warm, not like for like")
    ax.invert_yaxis()
    for path in report.write(name, data, "\n".join(md), {"throughput": fig}):
        print("wrote", path.relative_to(report.REPORTS.parent.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
