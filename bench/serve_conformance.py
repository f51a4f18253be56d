"""JSONSchemaBench through the server: every schema either yields valid JSON or a clear 400.

    python -m bench.serve_conformance                       # in-process gateway + engine, tiny random model
    python -m bench.serve_conformance --url http://127.0.0.1:8000 --model-name demo-moe   # a running server

Each of the 254 schemas in ../shared/conformance/jsonschemabench/ (or $MOESERVE_CONFORMANCE_DIR)
is sent as `response_format: json_schema` to POST /v1/completions (`--decodes` times, sampled,
several requests in flight). Counted per schema: refused with a 400 (and the refused feature,
from the gateway's moeserve_grammar_refused_total metric), outputs that validate, outputs
that do not (must be 0), outputs cut by max_tokens, and 5xx / transport failures (must be 0).
Writes bench/reports/serve_conformance.{json,md}.

The default in-process mode serves a random model: the adversary of grammar masking, since
it puts mass on every token the mask lets through. The library-level counterpart (no
server, no model) is the grammar layer's own conformance bench.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.conformance import conformance_dir, load_cases
from bench.oracle import check_output
from bench.report import write
from moeserve.grammar import GrammarSpec


async def run(base_url: str, model: str, transport: httpx.AsyncBaseTransport | None, args) -> dict:
    folder = conformance_dir()
    if folder is None:
        raise SystemExit("no conformance data (../shared/conformance/jsonschemabench or $MOESERVE_CONFORMANCE_DIR)")
    cases = load_cases(folder)[: args.limit or None]
    counts: Counter[str] = Counter()
    per_schema: list[dict] = []
    failures: list[str] = []
    latencies: list[float] = []
    tokens = 0
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, transport=transport, timeout=600) as client:

        async def one(case, decode: int) -> dict:
            nonlocal tokens
            body = {"model": model, "prompt": "Reply with JSON:\n", "max_tokens": args.max_tokens,
                    "temperature": 1.0, "seed": decode,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": case.schema}}}
            async with gate:
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    return {"outcome": "failure", "detail": f"transport: {e!r}"}
                latencies.append(time.perf_counter() - t0)
            if r.status_code == 400:
                return {"outcome": "refused", "detail": r.json()["error"]["message"]}
            if r.status_code != 200:
                return {"outcome": "failure", "detail": f"HTTP {r.status_code}: {r.text[:300]}"}
            data = r.json()
            tokens += data["usage"]["completion_tokens"]
            text, reason = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
            if reason != "stop":
                return {"outcome": "unterminated", "detail": f"{reason} after {data['usage']['completion_tokens']}"}
            verdict = check_output(GrammarSpec.json_schema(case.schema), text)
            return {"outcome": "valid" if verdict is None else "invalid", "detail": verdict or ""}

        async def schema(case) -> None:
            first = await one(case, 0)
            results = [first] if first["outcome"] == "refused" else [first] + list(
                await asyncio.gather(*(one(case, d) for d in range(1, args.decodes))))
            kinds = Counter(r["outcome"] for r in results)
            counts.update(kinds)
            counts["schemas_refused" if first["outcome"] == "refused" else "schemas_compiled"] += 1
            per_schema.append({"name": case.name, **kinds})
            for r in results:
                if r["outcome"] in ("invalid", "failure"):
                    failures.append(f"{case.name}: {r['outcome']}: {r['detail']}")

        t0 = time.perf_counter()
        await asyncio.gather(*(schema(c) for c in cases))
        wall = time.perf_counter() - t0
        metrics = (await client.get("/metrics")).text
    refused = Counter()
    for m in re.finditer(r'moeserve_grammar_refused_total\{feature="([^"]*)",kind="json_schema"\} (\S+)', metrics):
        refused[m.group(1) or "(none)"] += int(float(m.group(2)))
    guard = re.search(r"^moeserve_grammar_guard_refusals_total (\S+)", metrics, re.M)
    return {"schemas": len(cases), "counts": dict(counts), "refused_features": refused.most_common(),
            "failures": failures, "guard_refusals": float(guard.group(1)) if guard else None,
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "p50_latency_s": sorted(latencies)[len(latencies) // 2] if latencies else None,
            "per_schema": per_schema, "settings": vars(args)}


def in_process(args):
    """Gateway + EngineServer in this process on a tiny random MoE (no Ray)."""
    from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
    from deployments.engine_server import EngineServer
    from deployments.gateway import Gateway
    from moeserve.config import AppConfig

    folder = Path(args.model) if args.model else save_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny-moe")
    tree = AppConfig.from_dict({
        "model": {"name": MODEL_NAME, "path": str(folder)}, "speculative": {"draft": args.draft},
        "engine": {"max_num_seqs": args.concurrency, "max_model_len": args.max_tokens + 64, "max_queued_requests": 1024},
        "deployments": {"engine": {"max_ongoing_requests": args.concurrency + 1024}},
        "gateway": {"grpc_port": None, "max_body_bytes": 1 << 20, "request_timeout_s": None},
    })  # fmt: skip
    server = EngineServer(tree)
    return server, Gateway(server, tree), MODEL_NAME


def markdown(r: dict) -> str:
    c = r["counts"]
    lines = [
        "# JSONSchemaBench through the server", "",
        f"{r['schemas']} schemas; {r['settings']['decodes']} sampled decode(s) each (temperature 1, "
        f"max_tokens {r['settings']['max_tokens']}), {r['settings']['concurrency']} in flight; "
        f"mode: {r['settings']['url'] or 'in-process gateway + engine, tiny random MoE'}.", "",
        "| count | value |", "|---|---|",
        f"| schemas compiled | {c.get('schemas_compiled', 0)} |",
        f"| schemas refused with a 400 | {c.get('schemas_refused', 0)} |",
        f"| outputs valid | {c.get('valid', 0)} |",
        f"| outputs invalid (must be 0) | {c.get('invalid', 0)} |",
        f"| outputs cut by max_tokens | {c.get('unterminated', 0)} |",
        f"| 5xx / transport failures (must be 0) | {c.get('failure', 0)} |",
        f"| gateway guard refusals (must be 0) | {r['guard_refusals']} |",
        f"| wall time | {r['wall_s']:.1f} s |",
        f"| tokens generated, tokens/s | {r['tokens']}, {r['tokens_per_s']:.0f} |", "",
        "Most common refused features: " + (", ".join(f"`{f}` ({n})" for f, n in r["refused_features"][:10])
                                             or "none"), "",
    ]
    if r["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in r["failures"][:50]]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: in-process gateway + engine)")
    p.add_argument("--model-name", default="demo-moe", help="the served model id (with --url)")
    p.add_argument("--model", help="in-process: checkpoint folder (default: a tiny random MoE)")
    p.add_argument("--draft", default="ngram", choices=("none", "ngram"), help="in-process speculation")
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--limit", type=int, default=0, help="first N schemas only")
    args = p.parse_args()
    server = None
    if args.url:
        result = asyncio.run(run(args.url, args.model_name, None, args))
    else:
        server, gw, name = in_process(args)
        result = asyncio.run(run("http://gateway", name, httpx.ASGITransport(app=gw.http_app), args))
        server.shutdown()
    path = write("serve_conformance", result, markdown(result))[1]
    print(markdown(result))
    print(f"report: {path}")
    bad = result["counts"].get("invalid", 0) + result["counts"].get("failure", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
