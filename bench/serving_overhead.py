"""What serving costs: the served stack (HTTP -> HAProxy or Serve's proxy -> gateway -> engine replica -> core process)
against the same engine in this process (`moeserve.LLM`), side by side in one run.

    python -m bench.serving_overhead [--streams 32] [--max-tokens 64] [--runs 15] [--ingress haproxy|proxy|direct]
                                     [--set SECTION.KEY=VALUE] [--report NAME] [--quick]

Serve runs with deployments.local.SERVE_ENV (exported values win: RAY_SERVE_THROUGHPUT_OPTIMIZED=0
measures without Serve's throughput-optimized mode).

Three measurements over `--runs` alternating runs (values: medians; ratios: the median of the
per-run ratios with its bootstrap interval, bench/timing.py):

1. throughput: `--streams` concurrent greedy streams through HTTP (EOS ignored, so every
   request writes exactly --max-tokens) vs `LLM.generate` of the same prompts;
2. CPU per streamed token outside the engine core: CPU seconds of the proxy, gateway and
   engine-replica processes (read from /proc) over the served run, per token;
3. one stream alone: time to first token and inter-token latency, HTTP vs in-process.

It also checks that the served greedy text equals LLM.generate's. Both sides use the one
config (deployments/serve_config.yaml's engine settings, with max_num_seqs = --streams), so
both keep their prefix cache as configured and both see the same prompts every run: after
the warm-up each side finds the same prompt blocks cached. Writes
bench/reports/serving_overhead.{json,md,-throughput.png} (`--quick`: serving_overhead-quick*).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx
import psutil
import torch
import yaml

from bench.report import environment, markdown_table, write
from bench.serve_latency import stream_completion
from bench.timing import format_ratio, ratio_over_rounds
from deployments.local import serve_environment

INGRESS = ("haproxy", "proxy", "direct")

SERVING_PROCESSES = {"proxy": "ProxyActor", "gateway": "moeserve:gateway", "engine replica": "moeserve:engine",
                     "haproxy": "haproxy"}


def serving_pids() -> dict[str, list[int]]:
    """Ray worker processes by role, found by their process titles."""
    found: dict[str, list[int]] = {role: [] for role in SERVING_PROCESSES}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or [""]
        title = " ".join(cmd)
        for role, needle in SERVING_PROCESSES.items():
            if (title.startswith("ray::") and needle in title) or (role == "haproxy" and Path(cmd[0]).name == needle):
                found[role].append(p.pid)
    return found


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    out = {}
    for role, ids in pids.items():
        total = 0.0
        for pid in ids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        out[role] = total
    return out


async def stream_one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return await stream_completion(client, body)


async def served(base: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    pids = serving_pids()
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        outs = await asyncio.gather(*(stream_one(client, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        cpu1 = cpu_seconds(pids)
    tokens = sum(o["tokens"] for o in outs)
    cpu = {role: cpu1[role] - cpu0[role] for role in cpu0}
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": [o["text"] for o in outs],
            "cpu_us_per_token": {role: 1e6 * s / tokens for role, s in cpu.items()},
            "cpu_us_per_token_outside_core": 1e6 * sum(cpu.values()) / tokens}


def offline(llm, prompts: list[list[int]], params) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": [o.text for o in outs]}


def latency_offline(llm, prompt: list[int], params) -> dict:
    t0 = time.perf_counter()
    ttft, n = None, 0
    for _, out in llm.stream(prompt, params):
        ttft = ttft or time.perf_counter() - t0
        n = len(out.token_ids)
    e2e = time.perf_counter() - t0
    return {"ttft": ttft, "e2e": e2e, "tokens": n}


def itl_ms(run: dict) -> float:
    return 1000 * (run["e2e"] - run["ttft"]) / max(1, run["tokens"] - 1)


def start_server(cfg, http_port: int, ingress: str) -> tuple[str, str | None]:
    """The app as `moeserve serve` runs it (`ingress` "haproxy": Serve's HAProxy mode), or behind Serve's
    proxy ("proxy"), or ("direct") behind the proxy and also on the gateway replica's own HTTP port (Ray
    Serve's direct ingress), which Serve's controller hands out as the app's target."""
    if ingress != "haproxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    if ingress == "direct":
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    serve_environment()  # read by every Serve process Ray starts
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from bench.serve_app import wait_healthy
    from deployments.app import APP_NAME, build

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(build(cfg), name=APP_NAME, route_prefix="/")
    base = f"http://127.0.0.1:{http_port}"
    wait_healthy(base, timeout=300)
    if ingress != "direct":
        return base, None
    deadline = time.monotonic() + 120
    while True:  # the replica's port is allocated once it runs
        groups = ray.get(_get_global_client()._controller.get_target_groups.remote(APP_NAME))
        ports = [t.port for g in groups if g.protocol.name == "HTTP" for t in g.targets if t.port != http_port]
        if ports or time.monotonic() > deadline:
            break
        time.sleep(1)
    direct_base = f"http://127.0.0.1:{ports[0]}"
    wait_healthy(direct_base, timeout=60)
    return base, direct_base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="8 streams of 16 tokens, 3 runs (a smoke run)")
    p.add_argument("--http-port", type=int, default=8123)
    p.add_argument("--report", default=None, help="report name in bench/reports/ (default: serving_overhead, "
                   "or serving_overhead-quick)")
    p.add_argument("--ingress", choices=INGRESS, default="haproxy",
                   help="haproxy: as `moeserve serve` runs (Serve's HAProxy mode); proxy: Serve's proxy; direct: "
                        "each run also streams straight to the gateway replica's own port (Serve's direct ingress), "
                        "beside the proxy path. Report suffix: -proxy, -direct")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for both sides, e.g. engine.torch_threads=1 (YAML value)")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.max_tokens, args.runs = 8, 16, 3
    args.report = args.report or ("serving_overhead" + ("" if args.ingress == "haproxy" else f"-{args.ingress}")
                                  + ("-quick" if args.quick else ""))

    from demo.prompts import formulaic
    from moeserve.config import AppConfig
    from moeserve.engine.llm import LLM
    from moeserve.sampling_params import SamplingParams

    overrides = {"engine": {"max_num_seqs": args.streams}, "gateway": {"grpc_port": 0},
                 "deployments": {"engine": {"max_ongoing_requests": 4 * args.streams}}}
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        overrides.setdefault(section, {})[name] = yaml.safe_load(value)
    cfg = AppConfig.load("deployments/serve_config.yaml", overrides)
    llm = LLM(config=cfg)
    med = statistics.median
    prompts = formulaic(llm.tokenizer, args.streams)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    base, direct = start_server(cfg, args.http_port, args.ingress)
    name = cfg.model.name

    offline(llm, prompts[:4], params)  # warm both sides up
    asyncio.run(served(base, name, prompts[:4], args.max_tokens))
    # in-process at torch's default threads, and at the core process's (all but one core)
    threads = sorted({torch.get_num_threads(), cfg.engine.torch_threads or max(1, torch.get_num_threads() - 1)})
    runs: dict[str, list[dict]] = {"served": [], "served_1": [], "offline_1": [], "direct": [], "direct_1": []}
    runs |= {f"offline_{t}t": [] for t in threads}
    for i in range(args.runs):  # which side goes first alternates by run
        for side in (("served", "offline") if i % 2 == 0 else ("offline", "served")):
            if side == "served":
                for key, url in (("served", base), ("direct", direct))[:: 1 if i % 4 < 2 else -1]:
                    if url is not None:  # the two HTTP paths alternate which goes first too
                        runs[key].append(asyncio.run(served(url, name, prompts, args.max_tokens)))
                        runs[f"{key}_1"].append(asyncio.run(served_single(url, name, prompts[0], args.max_tokens)))
                continue
            for t in threads:
                torch.set_num_threads(t)
                runs[f"offline_{t}t"].append(offline(llm, prompts, params))
            runs["offline_1"].append(latency_offline(llm, prompts[0], params))
    offline_tps = {t: med(r["tokens_per_s"] for r in runs[f"offline_{t}t"]) for t in threads}
    best = max(offline_tps, key=offline_tps.get)

    result = {
        "settings": vars(args), "environment": environment(best),
        "serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
        "prefix_caching": "on" if cfg.engine.prefix_caching else "off",
        "served_tokens_per_s": med(r["tokens_per_s"] for r in runs["served"]),
        "offline_tokens_per_s": offline_tps[best], "offline_threads": best,
        "offline_tokens_per_s_by_threads": offline_tps,
        "cpu_us_per_token_outside_core": med(r["cpu_us_per_token_outside_core"] for r in runs["served"]),
        "cpu_us_per_token": {role: med(r["cpu_us_per_token"][role] for r in runs["served"])
                             for role in SERVING_PROCESSES},
        "ttft_ms": {"served": 1000 * med(r["ttft"] for r in runs["served_1"]),
                    "offline": 1000 * med(r["ttft"] for r in runs["offline_1"])},
        "itl_ms": {"served": med(itl_ms(r) for r in runs["served_1"]),
                   "offline": med(itl_ms(r) for r in runs["offline_1"])},
        "same_text": runs["served"][0]["texts"] == runs[f"offline_{best}t"][0]["texts"],
        "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "texts"} for r in v] for k, v in runs.items()},
    }
    result["served_over_offline"] = ratio_over_rounds([r["tokens_per_s"] for r in runs["served"]],
                                                      [r["tokens_per_s"] for r in runs[f"offline_{best}t"]])
    result["ttft_served_over_offline"] = ratio_over_rounds([r["ttft"] for r in runs["served_1"]],
                                                           [r["ttft"] for r in runs["offline_1"]])
    result["itl_served_over_offline"] = ratio_over_rounds([itl_ms(r) for r in runs["served_1"]],
                                                          [itl_ms(r) for r in runs["offline_1"]])
    if direct is not None:
        result["direct_ingress"] = direct_summary(runs, f"offline_{best}t")
    md = markdown(result, args)
    print(md)
    print("report:", write(args.report, result, md, {"throughput": figure(result, args)})[1])
    from ray import serve

    serve.shutdown()
    return 0


async def served_single(base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return await stream_one(client, model, prompt, max_tokens)


def markdown(r: dict, args) -> str:
    rows = [
        [f"{args.streams} streams, tokens/s", r["served_tokens_per_s"], r["offline_tokens_per_s"],
         r["served_over_offline"], ">= 0.8x"],
        ["1 stream, TTFT (ms)", r["ttft_ms"]["served"], r["ttft_ms"]["offline"], r["ttft_served_over_offline"], ""],
        ["1 stream, inter-token latency (ms)", r["itl_ms"]["served"], r["itl_ms"]["offline"],
         r["itl_served_over_offline"], "<= 1.2x"],
    ]
    cpu = [[role, us] for role, us in r["cpu_us_per_token"].items()]
    cpu.append(["all of them", r["cpu_us_per_token_outside_core"]])
    return "\n".join([
        "# Serving overhead: the served stack vs the same engine in one process", "",
        f"`python -m bench.serving_overhead{' --quick' if args.quick else ''}"
        f"{'' if args.ingress == 'haproxy' else ' --ingress ' + args.ingress}"
        + "".join(f" --set {s}" for s in args.set) + "`. "
        f"Greedy, {args.max_tokens} tokens per request (EOS ignored), held-out demo prompts; {args.runs} runs "
        "alternating the sides: values are medians, each ratio the median of the per-run ratios with its 90% "
        "bootstrap interval over the runs. Served: HTTP -> "
        + ("HAProxy (Serve's HAProxy mode)" if args.ingress == "haproxy" else "Serve proxy")
        + " -> gateway -> engine replica -> engine core process. In-process: `moeserve.LLM.generate` on the same engine settings, at the torch thread "
        f"count that was fastest ({r['offline_threads']}; by threads: "
        + ", ".join(f"{t}: {v:.0f} tokens/s" for t, v in r["offline_tokens_per_s_by_threads"].items()) + "). "
        "Serve's environment: " + ", ".join(f"`{k}={v}`" for k, v in sorted(r["serve_env"].items())) + ". "
        f"Both sides keep their prefix cache as configured (prefix caching {r['prefix_caching']}) and see the "
        "same prompts every run, so both reuse the same cached prompt blocks.", "",
        markdown_table(["", "served", "in-process", "ratio [90% interval]", "goal"], rows), "",
        f"Served greedy text identical to `LLM.generate`: {r['same_text']}.", "",
        "## CPU per streamed token outside the engine core (goal: <= 150 us)", "",
        markdown_table(["process", "CPU us / token"], cpu),
    ] + (direct_markdown(r["direct_ingress"]) if "direct_ingress" in r else []))


def direct_summary(runs: dict[str, list[dict]], offline_key: str) -> dict:
    """Direct ingress against the proxy path, run by run (both served by the same app)."""
    med = statistics.median
    return {
        "direct_over_offline": ratio_over_rounds([r["tokens_per_s"] for r in runs["direct"]],
                                                 [r["tokens_per_s"] for r in runs[offline_key]]),
        "tokens_per_s": {k: med(r["tokens_per_s"] for r in runs[k]) for k in ("served", "direct")},
        "direct_over_proxy": ratio_over_rounds([r["tokens_per_s"] for r in runs["direct"]],
                                               [r["tokens_per_s"] for r in runs["served"]]),
        "ttft_direct_over_proxy": ratio_over_rounds([r["ttft"] for r in runs["direct_1"]],
                                                    [r["ttft"] for r in runs["served_1"]]),
        "ttft_ms": {k: 1000 * med(r["ttft"] for r in runs[f"{k}_1"]) for k in ("served", "direct")},
        "cpu_us_per_token": {k: {role: med(r["cpu_us_per_token"][role] for r in runs[k]) for role in SERVING_PROCESSES}
                             for k in ("served", "direct")},
        "same_text": runs["direct"][0]["texts"] == runs["served"][0]["texts"],
    }


def direct_markdown(d: dict) -> list[str]:
    roles = list(SERVING_PROCESSES)
    cpu = [[path] + [d["cpu_us_per_token"][key][role] for role in roles]
           + [sum(d["cpu_us_per_token"][key].values())] for path, key in (("proxy", "served"), ("direct", "direct"))]
    return ["", "## Ray Serve's direct ingress against the proxy", "",
            "`--ingress direct`: Serve started with `RAY_SERVE_ENABLE_DIRECT_INGRESS=1`, so the gateway replica "
            "also listens on a port of its own (the controller's target for the app); each run streams through the "
            "proxy and straight to that port, in turn.", "",
            markdown_table(["", "proxy", "direct", "direct / proxy [90% interval]"], [
                ["tokens/s", d["tokens_per_s"]["served"], d["tokens_per_s"]["direct"], d["direct_over_proxy"]],
                ["1 stream, TTFT (ms)", d["ttft_ms"]["served"], d["ttft_ms"]["direct"], d["ttft_direct_over_proxy"]],
            ]), "",
            markdown_table(["path, CPU us / token", *roles, "all"], cpu), "",
            f"Direct ingress / in-process, all streams: {d['direct_over_offline']}. Same greedy text on both "
            f"paths: {d['same_text']}."]


def figure(r: dict, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["in-process\nLLM.generate", "served\n(HTTP)"], [r["offline_tokens_per_s"], r["served_tokens_per_s"]],
           color=["#888", "#2a7"])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{args.streams} greedy streams: served = {format_ratio(r['served_over_offline'])} in-process",
                 fontsize=9)
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
