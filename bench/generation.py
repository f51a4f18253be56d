"""Issue 2 harness: our in-process generation against transformers `generate`.

Same checkpoint, prompts and token counts (greedy, EOS ignored so every run writes the same
number of tokens): batch 1 (prompts one after another) and one batch of B prompts; plus
transformers' assisted generation with the demo draft (batch 1, its only mode). Runs are
interleaved round by round; tokens/s are medians, ratios the median of per-round ratios.

    python -m bench.generation [--quick] [--rounds R] [--batch B] [--new-tokens N]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from bench import report, workloads  # noqa: E402
from bench.prompts import formulaic  # noqa: E402
from bench.timing import interleaved, paired_ratio, summarize  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.engine import LLMEngine, SchedulerConfig  # noqa: E402
from moeserve.engine.factory import demo_checkpoint  # noqa: E402
from moeserve.engine.paged_runner import PagedRunner  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.generation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
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
        args.rounds, args.batch, args.new_tokens, args.prompts_b1 = 2, 4, 24, 2
    torch.set_num_threads(args.threads)
    env = report.environment(args.threads)

    tokenizer = load_tokenizer(args.target)
    prompts = formulaic(tokenizer, max(args.batch, args.prompts_b1))
    b1_prompts, batch_prompts = prompts[: args.prompts_b1], prompts[: args.batch]
    def our_engine(compile: bool) -> LLMEngine:  # the default cache: paged, 16-token blocks, prefix caching
        runner = PagedRunner(load_checkpoint(args.target), args.batch, 1024, args.batch * 1024 // 16 + 1,
                             compile=compile)
        return LLMEngine(runner, tokenizer, scheduler=SchedulerConfig(args.batch, 1 << 16, 1024, block_size=16))

    engine, compiled = our_engine(False), our_engine(True)
    compile_s = compiled.runner.compiled.warm_up((1,))
    hf_target = workloads.load_hf(args.target)
    hf_draft = workloads.load_hf(args.draft, args.num_assistant_tokens)
    hf_compiled = workloads.load_hf(args.target, compiled=True)

    # The same tokens on both sides first (our model equals transformers' on this checkpoint).
    reference = [workloads.hf_generate(hf_target, [p], args.new_tokens)[0] for p in batch_prompts]
    same = workloads.ours_outputs(engine, batch_prompts, args.new_tokens) == reference
    same_compiled = workloads.ours_outputs(compiled, batch_prompts, args.new_tokens) == reference
    same_hf_compiled = [workloads.hf_generate(hf_compiled, [p], args.new_tokens)[0] for p in b1_prompts] == reference[
        : len(b1_prompts)]
    n = args.new_tokens
    cases = {
        "ours b1": workloads.ours(engine, b1_prompts, n, 1),
        "ours compiled b1": workloads.ours(compiled, b1_prompts, n, 1),
        "transformers b1": workloads.hf(hf_target, b1_prompts, n, 1),
        "transformers + assistant b1": workloads.hf(hf_target, b1_prompts, n, 1, assistant=hf_draft),
        "transformers static+compile b1": workloads.hf(hf_compiled, b1_prompts, n, 1),
        f"ours b{args.batch}": workloads.ours(engine, batch_prompts, n, args.batch),
        f"ours compiled b{args.batch}": workloads.ours(compiled, batch_prompts, n, args.batch),
        f"transformers b{args.batch}": workloads.hf(hf_target, batch_prompts, n, args.batch),
        f"transformers static+compile b{args.batch}": workloads.hf(hf_compiled, batch_prompts, n, args.batch),
    }
    runs = interleaved(cases, args.rounds, desc="generation")
    summary = summarize(runs)
    ratios = {
        "ours / transformers, batch 1": paired_ratio(runs, "ours b1", "transformers b1"),
        f"ours / transformers, batch {args.batch}": paired_ratio(
            runs, f"ours b{args.batch}", f"transformers b{args.batch}"
        ),
        "ours compiled / transformers, batch 1": paired_ratio(runs, "ours compiled b1", "transformers b1"),
        f"ours compiled / transformers, batch {args.batch}": paired_ratio(
            runs, f"ours compiled b{args.batch}", f"transformers b{args.batch}"
        ),
        "ours compiled / transformers static+compile, batch 1": paired_ratio(
            runs, "ours compiled b1", "transformers static+compile b1"),
        f"ours compiled / transformers static+compile, batch {args.batch}": paired_ratio(
            runs, f"ours compiled b{args.batch}", f"transformers static+compile b{args.batch}"),
        "ours compiled / ours eager, batch 1": paired_ratio(runs, "ours compiled b1", "ours b1"),
        f"ours compiled / ours eager, batch {args.batch}": paired_ratio(
            runs, f"ours compiled b{args.batch}", f"ours b{args.batch}"
        ),
        "transformers + assistant / transformers, batch 1": paired_ratio(
            runs, "transformers + assistant b1", "transformers b1"
        ),
        "ours / transformers + assistant, batch 1": paired_ratio(runs, "ours b1", "transformers + assistant b1"),
    }

    for name, row in summary.items():
        print(f"{name:32s} {row['median_tokens_per_s']:8.1f} tokens/s  (min {row['min_tokens_per_s']:.1f}, "
              f"max {row['max_tokens_per_s']:.1f}, {row['runs']} runs)")
    for name, value in ratios.items():
        print(f"{name:48s} {value:6.2f}x")
    print(f"greedy tokens identical to transformers: eager {same}, compiled {same_compiled}, "
          f"transformers static+compile {same_hf_compiled}; "
          f"compiling the decode step took {compile_s:.1f} s")

    name = args.name or ("generation-quick" if args.quick else "generation")
    setup = report.portable({k: v for k, v in vars(args).items() if k != "name"})
    data = {"bench": "generation", "setup": setup, "environment": env, "tokens_identical": same,
            "compiled_tokens_identical": same_compiled, "hf_compiled_tokens_identical": same_hf_compiled,
            "compile_seconds": compile_s,
            "summary": summary, "ratios": ratios}
    md = [
        "# Generation: ours vs transformers `generate`",
        "",
        f"Demo MoE target, greedy, {n} new tokens per prompt (EOS ignored on both sides), "
        f"batch 1 = {args.prompts_b1} held-out chat prompts one after another, batch {args.batch} = one batch; "
        f"transformers' assisted generation with the demo draft ({args.num_assistant_tokens} tokens per step, "
        f"constant). {args.rounds} interleaved rounds; medians. torch threads: {args.threads}; load average "
        f"at start: {env['load_average_at_start'][0]:.1f} on {env['cpu_count']} cores.",
        "",
        report.markdown_table(
            ["case", "median tokens/s", "min", "max"],
            [[k, v["median_tokens_per_s"], v["min_tokens_per_s"], v["max_tokens_per_s"]] for k, v in summary.items()],
        ),
        "",
        report.markdown_table(["ratio (median of per-round ratios)", "x"], [[k, v] for k, v in ratios.items()]),
        "",
        f"Greedy tokens identical to transformers on all {len(batch_prompts)} prompts: **{same}** (eager), "
        f"**{same_compiled}** (compiled); transformers' own static cache + `torch.compile` writes the same tokens "
        f"too: **{same_hf_compiled}**. \"ours compiled\": decode passes as one `torch.compile`d graph "
        f"(model_shards/compiled_step.py; prefill stays eager); compiling took {compile_s:.1f} s in this run "
        "(inductor's on-disk cache makes a restart cheaper).",
        "",
        f"![tokens/s]({name}-throughput.png)",
    ]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(summary)
    med = [summary[k]["median_tokens_per_s"] for k in names]
    err = [[m - summary[k]["min_tokens_per_s"] for k, m in zip(names, med)],
           [summary[k]["max_tokens_per_s"] - m for k, m in zip(names, med)]]
    ax.barh(names, med, xerr=err, color=["C0" if k.startswith("ours") else "C1" for k in names])
    ax.set_xlabel("tokens/s (median, min-max)")
    ax.invert_yaxis()
    for path in report.write(name, data, "\n".join(md), {"throughput": fig}):
        print("wrote", path.relative_to(report.REPORTS.parent.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
