"""Speculation through the whole served stack (HTTP -> proxy -> gateway -> engine replica -> core
process), side by side in one run: no speculation, the draft in the engine's process, and the
draft as its own deployment (its worker on a CPU of its own).

    python -m bench.serve_speculative [--chats 6] [--rounds 9] [--max-tokens 128] [--no-pin]

The three configurations are three Serve applications on one Ray (deployments/serve_config.yaml
with `speculative` overridden), each under its own route prefix. Every round streams each prompt
set's chats one after another (batch 1, greedy, each reply up to its end of turn) to every
application, in a rotating order (bench/timing.py); tokens/s is completion tokens over wall time,
every ratio the median of per-round ratios with its bootstrap interval over the rounds
(bench.timing.paired). Every configuration must write the same text. Writes
bench/reports/serve_speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import httpx

from bench.report import environment, markdown_table, write
from bench.serve_latency import stream_completion
from bench.timing import LEVEL, format_ratio, interleaved, paired, summarize
from deployments.local import serve_environment

NONE = "no speculation"
DEPLOYMENT_VS_IN_PROCESS = "draft deployment / draft in-process"
CONFIGS = {  # route prefix, speculative overrides
    NONE: ("none", {"draft": "none"}),
    "draft in-process": ("inproc", {"draft": "model", "placement": "in_process"}),
    "draft deployment": ("deploy", {"draft": "model", "placement": "deployment"}),
}


def start(http_port: int, max_num_seqs: int, draft_cpus: list[int] | None) -> dict[str, str]:
    """Deploys every configuration; returns their base URLs by name."""
    import ray
    from ray import serve

    from bench.serve_app import wait_healthy
    from deployments.app import build
    from moeserve.config import AppConfig

    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)  # logical CPUs: three apps' replicas
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    bases = {}
    for name, (prefix, spec) in CONFIGS.items():
        if spec.get("placement") == "deployment" and draft_cpus:
            spec = {**spec, "draft_cpus": draft_cpus}
        cfg = AppConfig.load("deployments/serve_config.yaml", {
            "engine": {"max_num_seqs": max_num_seqs}, "gateway": {"grpc_port": 0}, "speculative": spec})
        serve.run(build(cfg), name=f"spec-{prefix}", route_prefix=f"/{prefix}")
        bases[name] = f"http://127.0.0.1:{http_port}/{prefix}"
        wait_healthy(bases[name], timeout=300)
    return bases


def chats_case(base: str, model: str, prompts: list[list[int]], max_tokens: int, texts: list[list[str]]):
    """A timing case: the chats one after another; each run's texts are appended to `texts`."""

    async def run() -> tuple[int, dict]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            outs = []
            for p in prompts:
                body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                outs.append(await stream_completion(client, body))
        texts.append([o["text"] for o in outs])
        return sum(o["tokens"] for o in outs), {}

    return lambda: asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=6, help="chats per prompt set")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds: the interval is over them")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--http-port", type=int, default=8124)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the draft deployment's worker unpinned (default: the last CPU, as speculative.draft_cpus)")
    args = ap.parse_args(argv)
    serve_environment()

    from demo.prompts import formulaic, free_form
    from moeserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("checkpoints/demo-moe")
    cpus = sorted(os.sched_getaffinity(0))
    draft_cpus = [cpus[-1]] if args.pin and len(cpus) > 1 else None
    bases = start(args.http_port, 4, draft_cpus)
    sets = {"formulaic": formulaic(tokenizer, args.chats), "free-form": free_form(tokenizer, args.chats)}
    result = {"settings": vars(args), "environment": environment(None), "draft_cpus": draft_cpus, "sets": {}}
    try:
        for set_name, prompts in sets.items():
            texts: dict[str, list[list[str]]] = {name: [] for name in CONFIGS}
            cases = {name: chats_case(base, "demo-moe", prompts, args.max_tokens, texts[name])
                     for name, base in bases.items()}
            runs = interleaved(cases, args.rounds, desc=set_name)
            summary = summarize(runs, NONE)
            first = texts[NONE][0]
            result["sets"][set_name] = {
                "summary": summary,
                DEPLOYMENT_VS_IN_PROCESS: paired(runs, "draft deployment", "draft in-process"),
                "tokens_per_s": {name: [r.tokens_per_s for r in rs] for name, rs in runs.items()},
                "same_text": all(out == first for outs in texts.values() for out in outs),
            }
            print(set_name, {n: str(s["ratio"]) for n, s in summary.items() if n != NONE},
                  DEPLOYMENT_VS_IN_PROCESS, result["sets"][set_name][DEPLOYMENT_VS_IN_PROCESS])
    finally:
        from ray import serve

        serve.shutdown()
    md = markdown(result, args)
    print(md)
    print("report:", write("serve_speculative", result, md)[1])
    return 0 if all(s["same_text"] for s in result["sets"].values()) else 1


def markdown(r: dict, args) -> str:
    lines = ["# Speculation through the served stack", "",
             f"`python -m bench.serve_speculative`: three Serve applications on one Ray (no speculation, the draft in "
             f"the engine's process, the draft deployment{' with its worker on CPU ' + str(r['draft_cpus'][0]) if r['draft_cpus'] else ''}), "
             f"{args.chats} chats per set streamed one after another over HTTP (batch 1, greedy, up to "
             f"{args.max_tokens} tokens each, to the end of turn), {args.rounds} interleaved rounds; every ratio is "
             f"the median of per-round ratios [its {LEVEL:.0%} bootstrap interval over the rounds]. Load average at start "
             f"{r['environment']['load_average_at_start'][0]:.1f} on {os.cpu_count()} CPUs.", ""]
    for set_name, s in r["sets"].items():
        rows = [[name, row["median_tokens_per_s"], row.get("ratio", "1.00x (baseline)")]
                for name, row in s["summary"].items()]
        lines += [f"## {set_name}", "", markdown_table(["configuration", "tokens/s (median)", "vs no speculation"], rows),
                  "", f"Draft deployment / draft in-process, median of per-round ratios [interval]: "
                  f"**{format_ratio(s[DEPLOYMENT_VS_IN_PROCESS])}**. Every configuration wrote the same text: "
                  f"{'yes' if s['same_text'] else '**no**'}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
