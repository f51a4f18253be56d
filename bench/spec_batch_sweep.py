"""Does speculation pay at every batch size? The demo pair, batch 1..32.

For each batch size B and prompt set (formulaic held-out demo chats, free-form requests, and the
formulaic chats constrained to the demo's JSON schema), side by side in one run, interleaved
round by round: no speculation; the draft in-process with a fixed k; the
same with speculation paused from `disable_by_batch_size` sequences (the old static rule);
adaptive k, chosen per batch-size bucket from measured step costs and acceptance (the
utility rule, moeserve/spec/policy.py); the same without its PayGuard (what the guard buys); and
adaptive k with the draft in a worker process of
its own (the draft deployment's worker and data channel, without Ray: `DraftProcess`), pinned
to the last CPU and the engine to the others. Greedy, so every case writes the same tokens;
ratios are medians of per-round ratios against no speculation. A run queues all its prompts and the
engine holds B sequences, refilling a finished row's place as a server does (--static-batches: groups
of B, each drained before the next; its stragglers finish at batch 1-3, and speculation that ends some
rows early leaves the rest to run at a smaller batch). A run holds at least --min-prompts prompts, and
more (whole groups of B, up to --max-prompts) until a plain run takes --min-seconds: a batch of JSON
replies drains in ~20 steps, and in runs that short a fresh engine's first drafting steps (PayGuard
measuring whether drafting pays) weighed a whole round.

    python -m bench.spec_batch_sweep [--quick] [--rounds R] [--batches 1,2,4,8,16,32] [--sets formulaic,free-form,json]
                                     [--min-seconds S] [--no-deployment] [--static-batches]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from bench import report, workloads  # noqa: E402
from bench.speculative import split_cpus  # noqa: E402
from bench.timing import interleaved, summarize  # noqa: E402
from demo.prompts import formulaic, free_form  # noqa: E402
from deployments.draft import DraftProcess, RemoteDraftProposer  # noqa: E402
from deployments.draft_worker import DraftServerConfig  # noqa: E402
from deployments.local import DEMO_SCHEMA  # noqa: E402
from model_shards import load_checkpoint  # noqa: E402
from moeserve.config import GrammarSection
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig  # noqa: E402
from moeserve.engine.draft_model import DraftModelProposer  # noqa: E402
from moeserve.engine.factory import demo_checkpoint  # noqa: E402
from moeserve.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from moeserve.spec import AdaptiveK, AdaptiveKConfig, PayGuard  # noqa: E402
from moeserve.tokenizer import load_tokenizer  # noqa: E402

NONE = "no speculation"
AGAIN = "no speculation again (A/A)"  # a second plain engine: how far two identical cases differ here
SETS = {"formulaic": "formulaic", "free-form": "free-form", "json": "formulaic, JSON schema"}  # --sets: row labels
DEPLOYMENT = "deployment, adaptive k<=8"
UNGUARDED = "adaptive k<=8, no PayGuard"  # the policy's cost model alone: what the guard buys


class _AlwaysPays(PayGuard):
    def allows(self, key: tuple) -> bool:
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_batch_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two batch sizes, fewer tokens and rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--sets", default=",".join(SETS), help="prompt sets, of: " + ", ".join(SETS))
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--min-prompts", type=int, default=16,
                    help="prompts per timed run at least (in groups of the batch): one 96-token reply is ~50 ms")
    ap.add_argument("--min-seconds", type=float, default=1.0,
                    help="more groups per run until a plain run takes this long (0: --min-prompts only)")
    ap.add_argument("--max-prompts", type=int, default=128, help="prompts per timed run at most (--min-seconds' cap)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step of the fixed-k cases (adaptive: at most 8)")
    ap.add_argument("--disable-by-batch-size", type=int, default=12, help="the static rule's threshold")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--static-batches", action="store_true", help="drain each group of B before the next (no refill)")
    ap.add_argument("--no-deployment", dest="deployment", action="store_false",
                    help="skip the draft worker process (the draft deployment's case)")
    ap.add_argument("--target", default=demo_checkpoint("demo-moe"))
    ap.add_argument("--draft", default=demo_checkpoint("demo-draft"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.batches, args.new_tokens, args.min_prompts, args.min_seconds = 2, "1,8", 32, 1, 0.0
    batches = [int(b) for b in args.batches.split(",")]
    num_prompts = max(batches + [args.min_prompts] + ([args.max_prompts] if args.min_seconds > 0 else []))
    torch.set_num_threads(args.threads)
    env = report.environment(args.threads)
    tokenizer = load_tokenizer(args.target)
    target, draft = load_checkpoint(args.target), load_checkpoint(args.draft)
    schema = GrammarCompiler(tokenizer, target.config.vocab_size, config=GrammarSection().grammar_config()).compile(GrammarSpec.json_schema(DEMO_SCHEMA))
    wanted = args.sets.split(",")
    if unknown := set(wanted) - set(SETS):
        ap.error(f"--sets: unknown {sorted(unknown)}; known: {', '.join(SETS)}")
    sets = {SETS[name]: ((free_form if name == "free-form" else formulaic)(tokenizer, num_prompts),
                         schema if name == "json" else None) for name in wanted}
    k, off = args.k, args.disable_by_batch_size
    worker, split = None, split_cpus() if args.deployment else None
    if args.deployment:
        worker = DraftProcess(DraftServerConfig(model_path=args.draft, max_num_seqs=max(batches), max_model_len=1024,
                                                torch_threads=1, cpus=split[1] if split else None))
        if split:
            os.sched_setaffinity(0, split[0])

    def case(prompts, batch: int, spec: SpecConfig | None, grammar, remote: bool = False, guarded: bool = True):
        adaptive = None
        if not guarded:
            adaptive = AdaptiveK(AdaptiveKConfig(spec.num_tokens))
            adaptive.guard = _AlwaysPays()
        if remote:
            proposer = RemoteDraftProposer((worker.address, worker.authkey), timeout_s=5.0)
        else:
            proposer = None if spec is None else DraftModelProposer(draft, batch, 1024)
        engine = LLMEngine(ModelRunner(target, batch, 1024, prefix_caching=False), tokenizer, SchedulerConfig(batch, 1 << 16, 1024),
                           proposer=proposer, spec=spec or SpecConfig(num_tokens=0), adaptive=adaptive)
        return workloads.ours(engine, prompts, args.new_tokens, batch, stop_at_eos=False, grammar=grammar,
                              continuous=not args.static_batches)

    def groups(prompts, batch: int, grammar) -> int:
        """Groups of `batch` per run: --min-prompts' worth, and more until a plain run takes --min-seconds."""
        n = max(1, args.min_prompts // batch)
        if args.min_seconds <= 0:
            return n
        one = case(prompts[:batch], batch, None, grammar)
        one()  # warm
        t0 = time.perf_counter()
        one()
        return max(n, min(math.ceil(args.min_seconds / (time.perf_counter() - t0)), max(1, args.max_prompts // batch)))

    rows = []
    try:
        for name, (prompts, grammar) in sets.items():
            for batch in batches:
                ps = prompts[: groups(prompts, batch, grammar) * batch]  # whole groups of `batch`
                cases = {
                    NONE: case(ps, batch, None, grammar),
                    f"k={k}": case(ps, batch, SpecConfig(num_tokens=k), grammar),
                    f"k={k}, off from {off} rows": case(ps, batch, SpecConfig(num_tokens=k, disable_by_batch_size=off),
                                                        grammar),
                    "adaptive k<=8": case(ps, batch, SpecConfig(num_tokens=8, adaptive=True), grammar),
                    UNGUARDED: case(ps, batch, SpecConfig(num_tokens=8, adaptive=True), grammar, guarded=False),
                }
                if worker is not None:
                    cases[DEPLOYMENT] = case(ps, batch, SpecConfig(num_tokens=8, adaptive=True), grammar, remote=True)
                cases[AGAIN] = case(ps, batch, None, grammar)
                summary = summarize(interleaved(cases, args.rounds, desc=f"{name} batch {batch}"), NONE)
                rows.append({"prompts": name, "batch": batch, "prompts per run": len(ps),
                             **{c: summary[c]["ratio"].median for c in cases if c != NONE},
                             "tokens/s, no speculation": summary[NONE]["median_tokens_per_s"],
                             "intervals": {c: (summary[c]["ratio"].low, summary[c]["ratio"].high) for c in cases if c != NONE}})
                print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items() if key != "intervals"})
    finally:
        if worker is not None:
            worker.close()

    cols = [c for c in rows[0] if c not in ("prompts", "batch", "prompts per run", "intervals")]

    def cell(r: dict, c: str) -> str:
        """A rule's median ratio with its 90% bootstrap interval over the rounds."""
        if c not in r["intervals"]:
            return f"{r[c]:.2f}"
        lo, hi = r["intervals"][c]
        return f"{r[c]:.2f} ({lo:.2f}-{hi:.2f})"

    # a quick run, or some of the sets, is written beside the full report, not over it
    report_name = ("spec_batch_sweep" + ("-quick" if args.quick else "") + ("-static" if args.static_batches else "")
                   + ("" if len(sets) == len(SETS) else "-" + "-".join(wanted)))
    table = ["| prompts | batch | prompts per run | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    table += [f"| {r['prompts']} | {r['batch']} | {r['prompts per run']} | " + " | ".join(cell(r, c) for c in cols)
              + " |" for r in rows]
    rules = [c for c in cols[:-1] if c != AGAIN]
    worst = {c: min(r[c] for r in rows) for c in rules}
    control = [r[AGAIN] for r in rows]
    below = [f"{c} at {r['batch']} ({r['prompts']}, {cell(r, c)})" for c in rules for r in rows
             if r["intervals"][c][1] < 0.97]
    md = "\n".join([
        "# Speculation by batch size", "",
        f"`python -m bench.spec_batch_sweep{' --static-batches' if args.static_batches else ''}`: demo pair, greedy, "
        f"{args.new_tokens} new tokens per prompt (EOS ignored), "
        + ("each group of B drained before the next" if args.static_batches else
           "all of a run's prompts queued, B sequences running (a finished row's place refilled)")
        + f", at least {args.min_prompts} prompts per run, and more "
        f"(up to {args.max_prompts}) until a plain run took {args.min_seconds:g} s, "
        f"{args.rounds} interleaved rounds; ratios are tokens/s against no speculation at the same batch "
        f"(median of per-round ratios; in brackets its 90% bootstrap interval over the rounds). torch threads: {args.threads}. The draft in the engine's process, except "
        f"'{DEPLOYMENT}': the draft deployment's worker in a process of its own (its data channel, no Ray)"
        f"{', pinned to the last CPU and the engine to the others' if split else ''}.", "",
        *table, "",
        "Worst row per rule: " + ", ".join(f"{c} {v:.2f}x" for c, v in worst.items()) + ".", "",
        f"The A/A control (a second engine without speculation, against the first) ranged "
        f"{min(control):.2f}-{max(control):.2f}x: a rule's row within that range of 1.00 is within this "
        f"machine's noise.", "",
        "Measurably below 0.97x (the interval wholly below it): " + ("; ".join(below) if below else "none") + ".", "",
        f"![ratio by batch]({report_name}-ratio.png)", ""])
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, sets):
        mine = [r for r in rows if r["prompts"] == name]
        for c in rules:
            ax.plot([r["batch"] for r in mine], [r[c] for r in mine], marker="o", label=c)
        ax.plot([r["batch"] for r in mine], [r[AGAIN] for r in mine], color="grey", ls="--", label=AGAIN)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.97, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("batch (sequences)")
    axes[0].set_ylabel("tokens/s vs no speculation")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    data = {"bench": "spec_batch_sweep", "setup": report.portable(vars(args)), "environment": env, "rows": rows}
    for path in report.write(report_name, data, md, {"ratio": fig}):
        print("wrote", path.relative_to(report.REPORTS.parent.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
