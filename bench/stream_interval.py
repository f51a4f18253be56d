"""Stream interval A/B: how often an engine replica sends a stream's chunks, through the server.

Every chunk crosses two Serve hops (engine -> gateway -> proxy) before it becomes an SSE
event. This runs the shipped app (one gateway, one engine replica, gRPC off) under each
setting in turn, redeploying in place, in rounds whose order rotates (as bench/timing.py
does): per round one warm-up wave and `--waves` measured waves of `--streams` concurrent
greedy streams (`--new-tokens` each, EOS ignored). Reports tokens/s (median over waves), the
ratio to the first setting (the median of per-round ratios, each round's tokens/s the median
of its waves, with the bootstrap interval over the rounds: bench.timing.ratio_over_rounds),
client-side TTFT and inter-token latency, and SSE events per request; writes
bench/reports/stream_interval.{json,md}.

    python -m bench.stream_interval [--rounds 7] [--waves 2] [--streams 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench import report  # noqa: E402
from bench.load_test import SERVE_CONFIG, Rec, free_port, pct, send, start_server, stop_server  # noqa: E402
from bench.timing import LEVEL, Ratio, ratio_over_rounds  # noqa: E402
from demo.prompts import formulaic  # noqa: E402

# name -> (engine.stream_interval_s, engine.stream_interval_max_s)
SETTINGS = {
    "every step": (0.0, 0.0),
    "fixed 25 ms": (0.025, 0.025),
    "25 ms, up to 100 ms by load": (0.025, 0.1),
}
ONE_REPLICA = {"num_replicas": 1, "autoscaling": None}


def app_config(interval: tuple[float, float]):
    from moeserve.config import AppConfig

    return AppConfig.load(SERVE_CONFIG, {
        "gateway": {"grpc_port": 0},
        "engine": {"stream_interval_s": interval[0], "stream_interval_max_s": interval[1]},
        "deployments": {"gateway": ONE_REPLICA, "engine": ONE_REPLICA},
    })


def deploy(cfg) -> None:
    from ray import serve

    from deployments.app import APP_NAME, build

    serve.run(build(cfg), name=APP_NAME, route_prefix="/")


async def wave(base: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    recs = [Rec("stream", "wave", j, 0.0) for j in range(len(prompts))]
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(j: int) -> None:
            body = {"model": model, "prompt": prompts[j], "stream": True, "max_tokens": new_tokens,
                    "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
            recs[j].start = time.perf_counter() - t0
            await send(client, "stream", "/v1/completions", body, recs[j], t0)

        await asyncio.gather(*(one(j) for j in range(len(prompts))))
        wall = time.perf_counter() - t0
    ok = [r for r in recs if r.ok]
    return {"ok": len(ok), "streams": len(recs), "tokens": sum(r.tokens for r in ok), "seconds": wall,
            "tokens_per_s": sum(r.tokens for r in ok) / wall,
            "ttft": [r.ttft for r in ok], "itl": [r.itl for r in ok if r.itl is not None],
            "events": [r.events for r in ok]}


def summary(waves: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [t for w in waves for t in w["ttft"]]
    itl = [t for w in waves for t in w["itl"]]
    return {
        "waves": len(waves), "ok": sum(w["ok"] for w in waves), "streams": sum(w["streams"] for w in waves),
        "tokens_per_s": statistics.median(w["tokens_per_s"] for w in waves),
        "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
        "itl_p50_ms": 1000 * pct(itl, 0.5), "itl_p99_ms": 1000 * pct(itl, 0.99),
        "events_per_request": statistics.mean(e for w in waves for e in w["events"]),
    }


def per_round(waves: list[dict[str, Any]], rounds: int) -> list[float]:
    """Each round's tokens/s: the median over that round's waves."""
    return [statistics.median(w["tokens_per_s"] for w in waves if w["round"] == r) for r in range(rounds)]


def ratios_to_first(rates: dict[str, list[float]]) -> dict[str, Ratio]:
    """Every setting after the first against the first, round by round."""
    first = next(iter(rates))
    return {name: ratio_over_rounds(r, rates[first]) for name, r in rates.items() if name != first}


def markdown(data: dict[str, Any]) -> str:
    s, rows, ratios = data["setup"], data["results"], data["ratios_to_first"]
    out = [
        "# Stream interval: chunks per stream through the server", "",
        f"Shipped app, one gateway + one engine replica, local Ray ({s['num_cpus']} logical CPUs) on "
        f"{data['environment'].get('cpu_count', '?')} cores. {s['rounds']} rounds (the settings' order rotating) "
        f"x {s['waves']} waves of {s['streams']} concurrent greedy streams ({s['new_tokens']} tokens, EOS ignored) "
        "per setting; tokens/s is the median over waves; vs first row is the median of per-round ratios (each "
        f"round's tokens/s the median of its waves) [its {LEVEL:.0%} bootstrap interval over the rounds]; TTFT "
        "and ITL are per request, measured by the client.", "",
        "| setting (engine.stream_interval_s -> _max_s) | tokens/s | vs first row | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | SSE events per request | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lo, hi = SETTINGS[name]
        out.append(f"| {name} ({lo * 1000:.0f} -> {hi * 1000:.0f} ms) | {r['tokens_per_s']:.0f} | "
                   f"{ratios.get(name, 'baseline')} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                   f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['events_per_request']:.1f} | "
                   f"{r['ok']}/{r['streams']} |")
    out += ["", "The interval only delays chunks after a stream's first token, so TTFT is not traded away; "
            "a longer interval means fewer, larger chunks (fewer Serve hops per token) at the cost of "
            "burstier delivery."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stream_interval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds: the ratios' interval is over them")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs for ray.init")
    args = ap.parse_args(argv)
    import torch

    from moeserve.tokenizer import load_tokenizer

    env = report.environment(torch.get_num_threads())
    first = app_config(next(iter(SETTINGS.values())))
    from moeserve.config import resolve_path

    prompts = formulaic(load_tokenizer(resolve_path(first.model.path)), args.streams)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    try:
        start_server(first, args.num_cpus, port)
        with tqdm(total=args.rounds * len(SETTINGS), desc="rounds x settings") as bar:
            names = list(SETTINGS)
            for rnd in range(args.rounds):
                shift = rnd % len(names)  # rotating, so that no setting always runs first after a redeploy
                for name in names[shift:] + names[:shift]:
                    cfg = app_config(SETTINGS[name])
                    deploy(cfg)
                    asyncio.run(wave(base, cfg.model.name, prompts, args.new_tokens))  # warm-up
                    for _ in range(args.waves):
                        w = asyncio.run(wave(base, cfg.model.name, prompts, args.new_tokens))
                        measured[name].append(w | {"round": rnd})
                    bar.update()
    finally:
        stop_server()
    rates = {name: per_round(waves, args.rounds) for name, waves in measured.items()}
    data = {
        "bench": "stream_interval",
        "setup": vars(args) | {"settings": SETTINGS, "serve_config": "deployments/serve_config.yaml"},
        "environment": env,
        "results": {name: summary(waves) for name, waves in measured.items()},
        "tokens_per_s_per_round": rates,
        "ratios_to_first": ratios_to_first(rates),
        "waves": {name: [{k: v for k, v in w.items() if k not in ("ttft", "itl", "events")} for w in waves]
                  for name, waves in measured.items()},
    }
    md = markdown(data)
    for path in report.write("stream_interval", data, md):
        print("wrote", path.relative_to(ROOT))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
