"""Request latency and tokens/s through the server, plain vs JSON-schema-constrained.

    moeserve serve &                                           # or any running server
    python -m bench.serve_latency --url http://127.0.0.1:8000 --model-name demo-moe
    python -m bench.serve_latency                              # in-process gateway + engine, tiny random MoE

Per mode (plain, json_schema): one stream at a time (TTFT and end-to-end latency p50/p90,
tokens/s), then `--concurrency` streams at once (aggregate tokens/s). Outputs are forced to
run their full `--max-tokens` in plain mode (ignore_eos); constrained outputs end when the
schema is complete, so their tokens/s, not their latency, is the comparable number.
Writes bench/reports/serve_latency.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench.report import write

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "name": {"enum": ["sourdough", "baguette", "croissant", "mawa cake"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 12}}, "required": ["name", "qty"],
            "additionalProperties": False}},
        "pickup": {"enum": ["morning", "afternoon"]},
    },
    "required": ["customer", "items", "pickup"],
    "additionalProperties": False,
}


async def one(client: httpx.AsyncClient, model: str, mode: str, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(time to first token, end-to-end seconds, completion tokens) of one streamed completion."""
    body = {"model": model, "prompt": f"Order {seed}: ", "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if mode == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    run = await stream_completion(client, body)
    return run["ttft"] or 0.0, run["e2e"], run["tokens"]


async def stream_completion(client: httpx.AsyncClient, body: dict) -> dict:
    """POST a streamed /v1/completions (with usage): its time to first text, end-to-end seconds,
    completion tokens and text."""
    t0 = time.perf_counter()
    ttft, text, tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                ttft = ttft or time.perf_counter() - t0
                text.append(event["choices"][0]["text"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens, "text": "".join(text)}


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000


async def measure(base_url: str, model: str, transport, args) -> dict:
    out = {}
    async with httpx.AsyncClient(base_url=base_url, transport=transport, timeout=600) as client:
        await one(client, model, "plain", 4, 0)  # warm up (and compile nothing twice)
        await one(client, model, "json_schema", args.max_tokens, 0)
        for mode in ("plain", "json_schema"):
            runs = [await one(client, model, mode, args.max_tokens, s) for s in range(args.requests)]
            ttft, e2e, toks = zip(*runs)
            t0 = time.perf_counter()
            together = await asyncio.gather(*(one(client, model, mode, args.max_tokens, 100 + s)
                                              for s in range(args.concurrency)))
            wall = time.perf_counter() - t0
            out[mode] = {
                "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
                "e2e_p50_ms": pct(e2e, 0.5), "mean_tokens": statistics.mean(toks),
                "single_stream_tokens_per_s": sum(toks) / sum(e2e),
                "concurrent_tokens_per_s": sum(t for _, _, t in together) / wall,
            }
    out["constrained_over_plain_single"] = (out["json_schema"]["single_stream_tokens_per_s"]
                                            / out["plain"]["single_stream_tokens_per_s"])
    out["constrained_over_plain_concurrent"] = (out["json_schema"]["concurrent_tokens_per_s"]
                                                / out["plain"]["concurrent_tokens_per_s"])
    return out


def markdown(r: dict, args) -> str:
    lines = ["# Latency and tokens/s through the server", "",
             f"mode: {args.url or 'in-process gateway + engine, tiny random MoE'}; {args.requests} sequential "
             f"requests, then {args.concurrency} concurrent; max_tokens {args.max_tokens}.", "",
             "| | TTFT p50 / p90 (ms) | e2e p50 (ms) | tokens/request | tokens/s, 1 stream | "
             f"tokens/s, {args.concurrency} streams |", "|---|---|---|---|---|---|"]
    for mode in ("plain", "json_schema"):
        m = r[mode]
        lines.append(f"| {mode} | {m['ttft_p50_ms']:.0f} / {m['ttft_p90_ms']:.0f} | {m['e2e_p50_ms']:.0f} | "
                     f"{m['mean_tokens']:.0f} | {m['single_stream_tokens_per_s']:.0f} | "
                     f"{m['concurrent_tokens_per_s']:.0f} |")
    lines += ["", f"constrained / plain tokens/s: {r['constrained_over_plain_single']:.2f} (1 stream), "
                  f"{r['constrained_over_plain_concurrent']:.2f} ({args.concurrency} streams)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: in-process gateway + engine)")
    p.add_argument("--model-name", default="demo-moe")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    server = None
    if args.url:
        result = asyncio.run(measure(args.url, args.model_name, None, args))
    else:
        from bench.serve_conformance import in_process

        args.model, args.draft = None, "ngram"
        server, gw, name = in_process(argparse.Namespace(model=None, draft="ngram", concurrency=args.concurrency,
                                                         max_tokens=args.max_tokens))
        result = asyncio.run(measure("http://gateway", name, httpx.ASGITransport(app=gw.http_app), args))
        server.shutdown()
    print(markdown(result, args))
    print(f"report: {write('serve_latency', result | {'settings': vars(args)}, markdown(result, args))[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
