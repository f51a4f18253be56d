"""Issue 4 bench: speculative decoding on the demo pair, against no speculation and transformers.

Greedy, so every case writes the same tokens: each reply up to its end of turn (or exactly
--new-tokens with --ignore-eos). Runs interleaved round by round; tokens/s are medians, ratios
the median of per-round ratios with a bootstrap interval over the rounds (bench/timing.py).
Like for like: every case prefills each prompt in full every run. Our target runs without prefix
caching and in-process drafts with prefix caching off; transformers' caches
live for one call. The one exception is labelled: the draft deployment's draft keeps its
prefix cache (as in serving), so its partner for "deployment / in-process" is an in-process
draft with its prefix cache on as well.

1. batch 1, formulaic prompts (held-out demo chats) and free-form prompts separately: no
   speculation, prompt lookup, the draft in-process (fixed k and adaptive k), the draft as a
   Serve deployment, transformers `generate` and `generate(assistant_model=draft)`;
2. a k sweep (formulaic, batch 1): speedup, alpha, tokens per pass against the formula
   (1 - alpha^(k+1)) / (1 - alpha), and where the time of a step goes;
3. batch B (formulaic): does speculation still pay when the batch already fills the step?

    python -m bench.speculative [--quick] [--rounds R] [--k K] [--no-serve]
"""

from __future__ import annotations

import argparse
import os

import torch

from bench import report, spec_report, workloads
from bench.timing import Case, format_ratio, interleaved, paired, summarize
from demo.prompts import formulaic, free_form
from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, ModelRunner, SchedulerConfig, SpecConfig
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.engine.factory import demo_checkpoint
from moeserve.spec import NgramProposer
from moeserve.tokenizer import load_tokenizer

NONE = "no speculation"
CACHED = spec_report.CACHED  # in-process drafts that keep their prefix cache, like the deployment's
COMPILED = "compiled draft"  # the draft's decode steps compiled (model_shards/compiled_step.py), the target eager


class Bench:
    """Models loaded once; engines built per case (each with its own KV cache and proposer)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.target)
        self.target = load_checkpoint(args.target)
        self.draft = load_checkpoint(args.draft)
        self.hf_target = workloads.load_hf(args.target)
        self.hf_draft = workloads.load_hf(args.draft, args.k)
        self.draft_handle = None

    def engine(self, proposer=None, k: int = 0, adaptive: bool = False, seqs: int = 16) -> LLMEngine:
        runner = ModelRunner(self.target, seqs, 1024, prefix_caching=False)
        spec = SpecConfig(num_tokens=k, adaptive=adaptive)
        return LLMEngine(runner, self.tokenizer, SchedulerConfig(seqs, 1 << 16, 1024), proposer=proposer, spec=spec)

    def drafter(self, seqs: int = 16, prefix_caching: bool = False, compile: bool = False) -> DraftModelProposer:
        """The draft in-process; without prefix caching it prefills every prompt every run, as the
        target and transformers do. compile: its decode steps as compiled graphs (`engine.compile`'s
        draft), the target staying eager."""
        return DraftModelProposer(self.draft, seqs, 1024, prefix_caching=prefix_caching, compile=compile)

    def ours(self, prompts, batch: int, proposer=None, k: int = 0, adaptive: bool = False) -> Case:
        engine = self.engine(proposer, k, adaptive, max(batch, 1))
        return workloads.ours(engine, prompts, self.args.new_tokens, batch, self.args.stop_at_eos)

    def hf(self, prompts, assistant=None) -> Case:
        return workloads.hf(self.hf_target, prompts, self.args.new_tokens, 1, assistant, self.args.stop_at_eos)

    def start_draft_deployment(self) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray
        from ray import serve

        from deployments.draft import DraftServerConfig, bind_draft

        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        cfg = DraftServerConfig(model_path=self.args.draft, max_num_seqs=16, max_model_len=1024, torch_threads=1,
                                cpus=self.args.draft_cpus)
        self.draft_handle = serve.run(bind_draft(cfg), name="bench-draft", route_prefix=None)

    def remote_drafter(self):
        """Each step over the replica's draft worker's data channel, asked for once."""
        from deployments.draft import RemoteDraftProposer

        channel = self.draft_handle.options(method_name="channel").remote().result(timeout_s=30)
        return RemoteDraftProposer(channel, timeout_s=5.0)

    def stop(self) -> None:
        if self.draft_handle is not None:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()


def compare(b: Bench, prompts: list[list[int]], label: str) -> dict:
    """Section 1 for one prompt set: every way of decoding, batch 1."""
    k = b.args.k
    cases = {
        NONE: b.ours(prompts, 1),
        f"prompt lookup k={k}": b.ours(prompts, 1, NgramProposer(), k),
        f"draft in-process k={k}": b.ours(prompts, 1, b.drafter(), k),
        "draft in-process adaptive k<=8": b.ours(prompts, 1, b.drafter(), 8, adaptive=True),
        f"draft in-process k={k}, {COMPILED}": b.ours(prompts, 1, b.drafter(compile=True), k),
        f"draft in-process adaptive k<=8, {COMPILED}": b.ours(prompts, 1, b.drafter(compile=True), 8, adaptive=True),
    }
    if b.draft_handle is not None:
        cases[f"draft in-process k={k}, {CACHED}"] = b.ours(prompts, 1, b.drafter(prefix_caching=True), k)
        cases[f"draft in-process adaptive k<=8, {CACHED}"] = b.ours(prompts, 1, b.drafter(prefix_caching=True), 8,
                                                                   adaptive=True)
        cases[f"draft deployment k={k}"] = b.ours(prompts, 1, b.remote_drafter(), k)
        cases["draft deployment adaptive k<=8"] = b.ours(prompts, 1, b.remote_drafter(), 8, adaptive=True)
    cases["transformers"] = b.hf(prompts)
    cases[f"transformers + assistant k={k}"] = b.hf(prompts, assistant=b.hf_draft)
    runs = interleaved(cases, b.args.rounds, desc=f"compare {label}")
    out = {"summary": summarize(runs, NONE), "spec": spec_report.spec_medians(runs),
           "steps": spec_report.step_costs(runs, NONE), "draft": spec_report.draft_medians(runs)}
    out["transformers assisted / transformers"] = paired(runs, f"transformers + assistant k={k}", "transformers")
    out["ours no speculation / transformers"] = paired(runs, NONE, "transformers")
    if b.draft_handle is not None:  # the bar: the deployment against the same draft in-process
        pairs = {f"k={k}": (f"draft deployment k={k}", f"draft in-process k={k}, {CACHED}"),
                 "adaptive k<=8": ("draft deployment adaptive k<=8", f"draft in-process adaptive k<=8, {CACHED}")}
        out["deployment / in-process"] = {c: paired(runs, *pair) for c, pair in pairs.items()}
    return out


def sweep(b: Bench, prompts: list[list[int]]) -> dict:
    """Section 2: k sweep with the draft and with prompt lookup, against no speculation."""
    cases = {NONE: b.ours(prompts, 1)}
    for k in b.args.sweep:
        cases[f"draft k={k}"] = b.ours(prompts, 1, b.drafter(), k)
        cases[f"lookup k={k}"] = b.ours(prompts, 1, NgramProposer(), k)
    runs = interleaved(cases, b.args.rounds, desc="k sweep")
    return {"summary": summarize(runs, NONE), "spec": spec_report.spec_medians(runs),
            "steps": spec_report.step_costs(runs, NONE)}


def batched(b: Bench, prompts: list[list[int]]) -> dict:
    """Section 3: the same at batch B."""
    k, batch = b.args.k, len(prompts)
    cases = {
        NONE: b.ours(prompts, batch),
        f"prompt lookup k={k}": b.ours(prompts, batch, NgramProposer(), k),
        f"draft in-process k={k}": b.ours(prompts, batch, b.drafter(batch), k),
        f"draft in-process k={k}, {COMPILED}": b.ours(prompts, batch, b.drafter(batch, compile=True), k),
    }
    runs = interleaved(cases, b.args.rounds, desc=f"batch {batch}")
    return {"summary": summarize(runs, NONE), "spec": spec_report.spec_medians(runs),
            "steps": spec_report.step_costs(runs, NONE)}


def split_cpus() -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(this process's CPUs, the draft worker's): the last CPU for the draft deployment's worker,
    the others for the engine that runs every case, in-process drafts included. Ray's own
    processes are started before this process is pinned, so they stay free to run anywhere."""
    cpus = sorted(os.sched_getaffinity(0))
    return (tuple(cpus[:-1]), (cpus[-1],)) if len(cpus) >= 2 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens, rounds and k values")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set at batch 1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128, help="at most this many tokens per prompt")
    ap.add_argument("--ignore-eos", dest="stop_at_eos", action="store_false",
                    help="write exactly --new-tokens per prompt instead of stopping at the end of the reply")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step in sections 1 and 3")
    ap.add_argument("--sweep", default="1,2,3,4,5,6,8")
    ap.add_argument("--no-serve", action="store_true", help="skip the draft deployment (no Ray)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", default=demo_checkpoint("demo-moe"))
    ap.add_argument("--draft", default=demo_checkpoint("demo-draft"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--pin", action="store_true",
                    help="with 2+ CPUs: the draft deployment's worker on the last CPU, and this process, whose "
                         "engine runs every case, on the others (default: placement left to the OS)")
    args = ap.parse_args(argv)
    split = split_cpus() if args.pin else None
    args.draft_cpus = split[1] if split else None
    if args.quick:
        args.rounds, args.prompts, args.batch, args.new_tokens, args.sweep = 3, 2, 4, 48, "2,4"
    args.sweep = [int(k) for k in str(args.sweep).split(",")]
    torch.set_num_threads(args.threads)
    env = report.environment(args.threads)

    b = Bench(args)
    try:
        if not args.no_serve:
            b.start_draft_deployment()
        if split:
            os.sched_setaffinity(0, split[0])
        sets = {"formulaic": formulaic(b.tokenizer, max(args.prompts, args.batch)), "free-form": free_form(
            b.tokenizer, args.prompts)}
        results = {
            "compare": {name: compare(b, ps[: args.prompts], name) for name, ps in sets.items()},
            "sweep": sweep(b, sets["formulaic"][: args.prompts]),
            "batched": batched(b, sets["formulaic"][: args.batch]),
        }
    finally:
        b.stop()
    name = args.name or ("speculative-quick" if args.quick else "speculative")
    data = {"bench": "speculative", "setup": report.portable({k: v for k, v in vars(args).items() if k != "name"}),
            "environment": env, **results}
    print(spec_report.console(results, args))
    md, figures = spec_report.render(results, args, env, name)
    for path in report.write(name, data, md, figures):
        print("wrote", path.relative_to(report.REPORTS.parent.parent))
    speedup = results["compare"]["formulaic"]["summary"][f"draft in-process k={args.k}"]["ratio"]
    print(f"goal (>= 2.5x over no speculation, formulaic, draft in-process k={args.k}): "
          f"{format_ratio(speedup)} -> {'met' if speedup.median >= 2.5 else 'not met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
