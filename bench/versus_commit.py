"""This tree's speculative decoding against an older commit's, on the same demo pair and prompts.

    python -m bench.versus_commit --base REV [--runs 4] [--rounds 5]

Checks REV out into a temporary git worktree, then runs, alternating this tree's process and REV's
(`--runs` times each), the same cases through each tree's own `bench.speculative.Bench`: no
speculation, the in-process draft at k=4 and at adaptive k<=8, on this tree's demo pair and the
same 8 formulaic prompts (written once, here), `--rounds` interleaved rounds per process. Each case's
tokens/s, this tree's over REV's, is the ratio of the pooled medians with a 90% percentile
bootstrap interval; and each tree's speculation ratio (draft over no speculation). Writes
bench/reports/versus_commit.{json,md}. REV must have `bench.speculative.Bench` with the same
arguments (true since the in-process draft got its own bench).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import report
from bench.timing import LEVEL

ROOT = Path(__file__).resolve().parent.parent
CASES = ("no speculation", "draft k=4", "draft adaptive k<=8")

# Run in each tree's own process: its Bench, the shared prompts, this tree's checkpoints.
CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from argparse import Namespace
from bench import speculative as S
from bench.timing import interleaved
prompts, ck, rounds = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
b = S.Bench(Namespace(target=ck + "/demo-moe", draft=ck + "/demo-draft", k=4, new_tokens=128, stop_at_eos=True))
cases = {"no speculation": b.ours(prompts, 1), "draft k=4": b.ours(prompts, 1, b.drafter(), 4),
         "draft adaptive k<=8": b.ours(prompts, 1, b.drafter(), 8, adaptive=True)}
runs = interleaved(cases, rounds, desc="rounds")
print("RESULT " + json.dumps({k: [r.tokens_per_s for r in rs] for k, rs in runs.items()}))
"""


def run_tree(tree: Path, prompts_file: Path, rounds: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(prompts_file), str(ROOT / "checkpoints"), str(rounds)],
                         cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("RESULT ") + 7:])


def median_ratio(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """median(a) / median(b) and its percentile bootstrap interval (each side resampled on its own)."""
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                  for _ in range(resamples))
    tail = (1 - LEVEL) / 2
    return {"median": statistics.median(a) / statistics.median(b), "low": boot[int(tail * resamples)],
            "high": boot[int((1 - tail) * resamples) - 1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.versus_commit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the older commit (any git revision)")
    ap.add_argument("--runs", type=int, default=4, help="processes per tree, alternating")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per process")
    args = ap.parse_args(argv)
    from demo.prompts import formulaic
    from moeserve.tokenizer import load_tokenizer

    prompts = formulaic(load_tokenizer(str(ROOT / "checkpoints" / "demo-moe")), 8)
    values: dict[str, dict[str, list[float]]] = {"new": {c: [] for c in CASES}, "old": {c: [] for c in CASES}}
    with tempfile.TemporaryDirectory() as tmp:
        base, prompts_file = Path(tmp) / "base", Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for i in range(args.runs):
                for side, tree in (("old", base), ("new", ROOT)) if i % 2 else (("new", ROOT), ("old", base)):
                    print(f"run {i + 1}/{args.runs}: {side}", flush=True)
                    for case, tps in run_tree(tree, prompts_file, args.rounds).items():
                        values[side][case] += tps
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    rows, data = [], {"base": args.base, "runs": args.runs, "rounds": args.rounds, "cases": {}}
    for case in CASES:
        new, old = values["new"][case], values["old"][case]
        r = median_ratio(new, old)
        data["cases"][case] = {"new_tokens_per_s": new, "old_tokens_per_s": old, "new_over_old": r}
        rows.append([case, f"{statistics.median(new):.1f}", f"{statistics.median(old):.1f}",
                     f"{r['median']:.3f}x [{r['low']:.3f}, {r['high']:.3f}]"])
    for side in ("new", "old"):
        plain = statistics.median(values[side]["no speculation"])
        data[f"{side}_speedup"] = {c: statistics.median(values[side][c]) / plain for c in CASES[1:]}
    md = "\n".join([
        "# This tree against an older commit: speculative decoding, same pair and prompts", "",
        f"`python -m bench.versus_commit --base {args.base} --runs {args.runs} --rounds {args.rounds}`: each tree in "
        f"its own process, {args.runs} alternating processes each, {args.rounds} interleaved rounds per process, "
        "batch 1, greedy, this tree's demo pair, the same 8 formulaic prompts. Ratio: pooled medians, "
        f"{int(LEVEL * 100)}% bootstrap interval.", "",
        report.markdown_table(["case", "tokens/s here", f"tokens/s at {args.base}", "here / there"], rows), "",
        "Speculation over no speculation: here " + ", ".join(f"{c} {v:.2f}x" for c, v in data["new_speedup"].items())
        + f"; at {args.base} " + ", ".join(f"{c} {v:.2f}x" for c, v in data["old_speedup"].items()) + ".", ""])
    print(md)
    for path in report.write("versus_commit", data, md):
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
