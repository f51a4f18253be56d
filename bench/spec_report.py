"""What bench/speculative.py reports: speculation metrics, step-time breakdowns, tables, plots."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.report import markdown_table  # noqa: E402
from bench.timing import Run, format_ratio, ratio_over_rounds  # noqa: E402
from moeserve.spec.metrics import expected_tokens_per_pass  # noqa: E402

CACHED = "draft prefix cache on"  # the label of in-process drafts that keep their prefix cache
SPEC_KEYS = ("alpha", "acceptance_rate", "mean_k", "tokens_per_pass", "predicted_tokens_per_pass", "draft_time_share")


def spec_medians(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Per speculative case, the median over runs of each speculation metric."""
    out = {}
    for name, rs in runs.items():
        specs = [r.extra["spec"] for r in rs if "spec" in r.extra and r.extra["spec"]["num_steps"]]
        if specs:
            out[name] = {key: statistics.median(s[key] for s in specs) for key in SPEC_KEYS}
    return out


def draft_medians(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Per draft-deployment case: median pre-draft hit rate, wait per call (ms) and fallback steps."""
    out = {}
    for name, rs in runs.items():
        drafts = [r.extra["draft"] for r in rs if "draft" in r.extra]
        if drafts:
            out[name] = {key: statistics.median(d[key] for d in drafts) for key in drafts[0]}
    return out


def step_costs(runs: dict[str, list[Run]], baseline: str) -> dict[str, dict[str, float]]:
    """Where a decode step's time goes, per case (medians over runs, milliseconds):
    draft and target (verify) time per step from the engine's own timers, the rest of the
    step (sampling, rejection, bookkeeping), and the plain step it replaces; the step's cost
    and decode rate against the plain step's as per-round ratios (bench.timing.Ratio)."""
    base = [r.extra["decode_s"] / r.extra["decode_steps"] for r in runs[baseline]]
    out = {}
    for name, rs in runs.items():
        if "decode_s" not in rs[0].extra:  # transformers: no step timers
            continue
        steps = [r.extra["decode_steps"] for r in rs]
        step = [r.extra["decode_s"] / n for r, n in zip(rs, steps)]
        row = {
            "step_ms": 1e3 * statistics.median(step),
            "plain_step_ms": 1e3 * statistics.median(base),
            "step_cost_vs_plain": ratio_over_rounds(step, base),
            "tokens_per_step": statistics.median(r.extra["decode_tokens"] / n for r, n in zip(rs, steps)),
            "decode_speedup": ratio_over_rounds([r.extra["decode_tokens"] / r.extra["decode_s"] for r in rs],
                                                [p.extra["decode_tokens"] / p.extra["decode_s"] for p in runs[baseline]]),
        }
        specs = [r.extra.get("spec") for r in rs]
        if all(specs) and all(s["num_steps"] for s in specs):
            # Per speculative step; steps where nothing was proposed ran plain and are not in these.
            row["draft_ms"] = 1e3 * statistics.median(s["draft_time_s"] / s["num_steps"] for s in specs)
            row["target_ms"] = 1e3 * statistics.median(s["target_time_s"] / s["num_steps"] for s in specs)
            row["speculative_steps"] = statistics.median(s["num_steps"] / n for s, n in zip(specs, steps))
            if row["speculative_steps"] == 1.0:
                row["other_ms"] = row["step_ms"] - row["draft_ms"] - row["target_ms"]
        out[name] = row
    return out


def console(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    for label, res in results["compare"].items():
        tokens = res["summary"]["no speculation"]["tokens"]
        lines.append(f"== batch 1, {label} prompts ({args.prompts} prompts, {tokens} tokens)")
        for name, row in res["summary"].items():
            spec = res["spec"].get(name)
            extra = f"  alpha {spec['alpha']:.2f}, tokens/pass {spec['tokens_per_pass']:.2f}" if spec else ""
            draft = res.get("draft", {}).get(name)
            if draft:
                extra += f", pre-draft hits {draft['predraft_hit_rate']:.0%}, wait {draft['wait_ms_per_call']:.2f} ms/call"
            ratio = format_ratio(row["ratio"]) if "ratio" in row else "baseline"
            lines.append(f"  {name:44s} {row['median_tokens_per_s']:7.1f} tokens/s  {ratio:>20s}{extra}")
        lines.append(f"  transformers assisted / transformers: {res['transformers assisted / transformers']}")
        if "deployment / in-process" in res:
            lines.append("  draft deployment / draft in-process (its prefix cache on too): "
                         + ", ".join(f"{c} {v}" for c, v in res["deployment / in-process"].items()))
        counts = {name: row["tokens"] for name, row in res["summary"].items()}
        if len(set(counts.values())) > 1:
            lines.append(f"  WARNING: cases wrote different numbers of tokens: {counts}")
    lines.append("== k sweep (formulaic, batch 1)")
    for name, row in results["sweep"]["summary"].items():
        spec = results["sweep"]["spec"].get(name)
        if spec:
            lines.append(f"  {name:12s} {row['ratio']}  alpha {spec['alpha']:.2f}  tokens/pass "
                         f"{spec['tokens_per_pass']:.2f} (formula {spec['predicted_tokens_per_pass']:.2f})")
    lines.append(f"== batch {args.batch} (formulaic)")
    for name, row in results["batched"]["summary"].items():
        lines.append(f"  {name:34s} {row['median_tokens_per_s']:7.1f} tokens/s  {row.get('ratio', 'baseline')}")
    return "\n".join(lines)


def _compare_table(res: dict[str, Any]) -> str:
    rows = []
    for name, row in res["summary"].items():
        spec = res["spec"].get(name, {})
        rows.append([name, row["median_tokens_per_s"], row.get("ratio", "baseline"),
                     spec.get("alpha", "-"), spec.get("tokens_per_pass", "-"),
                     spec.get("predicted_tokens_per_pass", "-")])
    table = markdown_table(["case", "tokens/s (median)", "vs no speculation [90% interval]", "alpha", "tokens/pass",
                            "formula"], rows)
    drafts = res.get("draft", {})
    if not drafts:
        return table
    rows = [[name, d["predraft_hit_rate"], d["wait_ms_per_call"], d["fallback_steps"]] for name, d in drafts.items()]
    return table + "\n\nDraft deployment (medians per run): rows answered from a pre-draft, time a step waited for " \
        "its drafts, steps decoded without drafts.\n\n" + markdown_table(
            ["case", "pre-draft hit rate", "draft wait ms / call", "fallback steps"], rows)


def _steps_table(res: dict[str, Any]) -> str:
    rows = []
    for name, row in res["steps"].items():
        spec = res["spec"].get(name, {})
        rows.append([name, spec.get("alpha", "-"), row.get("speculative_steps", "-"), row["tokens_per_step"],
                     row["step_ms"], row.get("draft_ms", "-"), row.get("target_ms", "-"), row.get("other_ms", "-"),
                     row["step_cost_vs_plain"], row["decode_speedup"]])
    header = ["case", "alpha", "share of steps speculative", "tokens/step", "step ms", "draft ms / spec step",
              "target ms / spec step", "other ms", "step cost / plain step", "decode speedup"]
    return markdown_table(header, rows)


def render(results: dict[str, Any], args: argparse.Namespace, env: dict, name: str) -> tuple[str, dict]:
    """The Markdown report and its figures."""
    k = args.k
    md = [
        "# Speculative decoding on the demo pair",
        "",
        "Demo MoE target + demo dense draft, greedy, so every case writes the same tokens: "
        + (f"each reply up to its end of turn (at most {args.new_tokens} tokens; the end token is not counted)"
           if args.stop_at_eos else f"{args.new_tokens} tokens per prompt, EOS ignored")
        + f". {args.rounds} interleaved rounds after one untimed warm-up each; tokens/s are medians, every ratio "
        "is the median of the per-round ratios with, in brackets, its 90% bootstrap interval over the rounds. "
        "Like for like: every case prefills each prompt in full every run (our target "
        "without prefix caching; our in-process drafts with prefix caching off; transformers' caches live for "
        "one call), except the draft deployment, whose draft keeps its prefix cache as in serving: its "
        f"partners in 'deployment / in-process' are the in-process drafts marked '{CACHED}'. Cases marked "
        "'compiled draft' run the draft's decode steps as compiled graphs (what `engine.compile: true` gives "
        "the draft), the target eager as in every other case. "
        f"Batch 1 runs {args.prompts} prompts one after another. torch threads: "
        f"{args.threads}; load average at start {env['load_average_at_start'][0]:.1f} on {env['cpu_count']} "
        "cores (a shared machine: absolute numbers move, ratios measured side by side move less). "
        + (f"CPUs pinned: the draft deployment's worker on CPU {args.draft_cpus[0]}, the engine on the others."
           if getattr(args, "draft_cpus", None) else "CPU placement left to the OS."),
        "",
    ]
    for label, res in results["compare"].items():
        md += [f"## Batch 1, {label} prompts", "", _compare_table(res), "",
               f"transformers `generate(assistant_model=draft)` / `generate`: "
               f"**{res['transformers assisted / transformers']}**; our engine without speculation / "
               f"transformers: {res['ours no speculation / transformers']}." + (
                   f" Draft deployment / the same draft in-process ({CACHED}, as the deployment's): " + ", ".join(
                       f"{c} **{v}**" for c, v in res["deployment / in-process"].items()) + "."
                   if "deployment / in-process" in res else ""), "", _steps_table(res), ""]
    md += ["## k sweep (formulaic, batch 1)", "", _compare_table(results["sweep"]), "",
           f"![speedup and alpha against k]({name}-sweep.png) ![tokens per pass against the formula]({name}-tpp.png)",
           "", "### Where a decode step's time goes", "",
           "Engine timers per decode step (medians): drafting, the target's verification pass, and the rest; "
           "'step cost / plain step' is the step's time over a plain decode step's, so the decode speedup is "
           "tokens/step divided by it.", "", _steps_table(results["sweep"]), "",
           f"## Batch {args.batch} (formulaic)", "", _compare_table(results["batched"]), "",
           _steps_table(results["batched"]), ""]
    losers = [f"- {label}: {name} ({row['ratio']})"
              for label, res in [*[(f"batch 1, {k}", v) for k, v in results["compare"].items()],
                                 (f"batch {args.batch}, formulaic", results["batched"])]
              for name, row in res["summary"].items()
              if "ratio" in row and row["ratio"].median < 1.0 and not name.startswith("transformers")]
    md += ["## Where speculation does not pay here (slower than no speculation)", "", *(losers or ["- nowhere"]), ""]
    figures = {"sweep": _sweep_figure(results["sweep"], args), "tpp": _tpp_figure(results["sweep"], args)}
    md.append(f"Goal: >= 2.5x over no speculation on formulaic prompts (draft in-process, k={k}): measured "
              f"**{results['compare']['formulaic']['summary'][f'draft in-process k={k}']['ratio']}**.")
    return "\n".join(md), figures


def _sweep_figure(res: dict[str, Any], args: argparse.Namespace):
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for kind, color in (("draft", "C0"), ("lookup", "C2")):
        ks = [k for k in args.sweep if f"{kind} k={k}" in res["summary"]]
        ratios = [res["summary"][f"{kind} k={k}"]["ratio"] for k in ks]
        ax.errorbar(ks, [r.median for r in ratios], yerr=[[r.median - r.low for r in ratios],
                    [r.high - r.median for r in ratios]], fmt="o-", color=color, capsize=3,
                    label=f"{kind}: speedup (90% interval)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("tokens/s vs no speculation")
    twin = ax.twinx()
    for kind, color in (("draft", "C0"), ("lookup", "C2")):
        ks = [k for k in args.sweep if f"{kind} k={k}" in res["spec"]]
        twin.plot(ks, [res["spec"][f"{kind} k={k}"]["alpha"] for k in ks], "s--", color=color, alpha=0.6,
                  label=f"{kind}: alpha")
    twin.set_ylabel("alpha")
    twin.set_ylim(0, 1)
    fig.legend(loc="upper left", fontsize=8, bbox_to_anchor=(0.12, 0.88))
    return fig


def _tpp_figure(res: dict[str, Any], args: argparse.Namespace):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for kind, color in (("draft", "C0"), ("lookup", "C2")):
        ks = [k for k in args.sweep if f"{kind} k={k}" in res["spec"]]
        spec = [res["spec"][f"{kind} k={k}"] for k in ks]
        ax.plot(ks, [s["tokens_per_pass"] for s in spec], "o", color=color, label=f"{kind}: measured")
        ax.plot(ks, [expected_tokens_per_pass(s["alpha"], s["mean_k"]) for s in spec], "-", color=color,
                alpha=0.6, label=f"{kind}: (1 - a^(k+1)) / (1 - a)")
    ax.set_xlabel("k")
    ax.set_ylabel("tokens per target pass")
    ax.legend(fontsize=8)
    return fig
