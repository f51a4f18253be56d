"""Tool calling, randomized, with the official openai client against the gateway (in-process engine,
the demo pair): held-out tool chats asked with a random tool_choice (none / auto / required / a named
function), parallel_tool_calls on or off, streamed or not, and half of them cut short by max_tokens.

Counted per request: internal call syntax in `content` (must be 0), calls whose arguments fail the
function's schema (a forced call's must not; a cut call's must be a prefix of valid JSON), more calls
than `parallel_tool_calls: false` allows, and a named call's arguments equal to the reference's.

    python -m bench.tool_calls [--requests 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter

import httpx
import jsonschema
import openai
from tqdm import tqdm

from bench import report
from demo.corpus import iter_documents, tool_call_args
from deployments.engine_server import EngineServer
from deployments.gateway import Gateway
from model_shards import load_checkpoint
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, ModelRunner
from moeserve.engine.factory import demo_checkpoint
from moeserve.tokenizer import CALL_OPEN, load_tokenizer

SYNTAX = (CALL_OPEN, "<tool_call", "</tool_call", '{"name": ')


def json_prefix(text: str, schema: dict) -> bool:
    """Whether `text` starts a document valid under `schema` (xgrammar's string matcher)."""
    import xgrammar as xgr

    grammar = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_json_schema(json.dumps(schema))
    return xgr.GrammarMatcher(grammar).accept_string(text)


def _tool_chats(n: int) -> list:
    chats = (s for s in iter_documents("heldout") if s.kind == "tool_call" and s.tools)
    return [next(chats) for _ in range(n)]


async def _ask(client: openai.AsyncOpenAI, body: dict) -> tuple[str | None, list, str]:
    """(content, [(name, arguments text)], finish_reason), streamed or not."""
    if not body["stream"]:
        r = await client.chat.completions.create(**body)
        m = r.choices[0].message
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], r.choices[0].finish_reason
    content, calls, finish = "", [], None
    async for chunk in await client.chat.completions.create(**body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return content or None, calls, finish


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=demo_checkpoint("demo-moe"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    tree = AppConfig.from_dict({"model": {"name": "demo-moe", "path": args.model}, "gateway": {"grpc_port": None}})
    tokenizer = load_tokenizer(args.model)
    server = EngineServer(tree, engine=LLMEngine(ModelRunner(load_checkpoint(args.model), 8, 1024), tokenizer))
    transport = httpx.ASGITransport(app=Gateway(server, tree).http_app)
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", max_retries=0, http_client=httpx.AsyncClient(
        transport=transport, base_url="http://gateway", timeout=300))
    # the failures counted, listed even when none happened
    counts = Counter(dict.fromkeys(("syntax in content", "too many calls", "calls where none allowed",
                                    "no call where forced, not cut", "invalid arguments", "cut calls not a JSON prefix"), 0))
    by_choice, examples = Counter(), []
    named_right = named = 0

    async def run() -> None:
        nonlocal named_right, named
        for sample in tqdm(_tool_chats(args.requests), desc="tool requests"):
            call = tool_call_args(sample.openai_messages)
            upto = next((i for i, m in enumerate(sample.openai_messages) if m.get("tool_calls")), -1)
            messages = sample.openai_messages[:upto]
            functions = {t["function"]["name"]: t["function"]["parameters"] for t in sample.tools}
            choice = rng.choice(["none", "auto", "required", "named"] if call else ["none", "auto", "required"])
            tool_choice = {"type": "function", "function": {"name": call[0]}} if choice == "named" else choice
            cut = rng.random() < 0.5
            body = {"model": "demo-moe", "messages": messages, "tools": sample.tools, "tool_choice": tool_choice,
                    "parallel_tool_calls": rng.random() < 0.5, "stream": rng.random() < 0.5, "temperature": 0,
                    "max_tokens": rng.randint(4, 24) if cut else 160}
            content, calls, finish = await _ask(client, body)
            by_choice[choice] += 1
            counts["requests"] += 1
            if any(s in (content or "") for s in SYNTAX):
                counts["syntax in content"] += 1
                examples.append((choice, body["max_tokens"], content[:160]))
            counts["too many calls"] += len(calls) > 1 and not body["parallel_tool_calls"]
            counts["calls where none allowed"] += choice == "none" and bool(calls)
            counts["no call where forced, not cut"] += choice in ("required", "named") and not calls and finish != "length"
            for name, arguments in calls:
                counts["calls"] += 1
                if finish == "length":
                    counts["cut calls"] += 1
                    counts["cut calls not a JSON prefix"] += not json_prefix(arguments, functions[name])
                    continue
                try:
                    jsonschema.validate(json.loads(arguments), functions[name])
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    counts["invalid arguments"] += 1
                    examples.append((choice, body["max_tokens"], arguments[:160]))
                if choice == "named":
                    named += 1
                    named_right += json.loads(arguments) == call[1]

    try:
        asyncio.run(run())
    finally:
        server.shutdown()
    result = {"counts": dict(counts), "by_choice": dict(by_choice), "named_whole": named,
              "named_arguments_right": named_right / max(named, 1)}
    print(json.dumps(result, indent=1))
    for example in examples[:5]:
        print("failed:", example)
    rows = [[k, v] for k, v in sorted(counts.items())]
    md = "\n".join([
        "# Tool calls, randomized", "",
        f"`python -m bench.tool_calls --requests {args.requests} --seed {args.seed}`: {__doc__.split(chr(10) + chr(10))[0]}", "",
        report.markdown_table(["count", "requests or calls"], rows), "",
        f"tool_choice drawn: {', '.join(f'{k} {v}' for k, v in sorted(by_choice.items()))}. Named calls not cut: {named}, "
        f"arguments equal to the reference's: **{100 * result['named_arguments_right']:.1f}%**.", ""])
    data = {"bench": "tool_calls", "setup": report.portable(vars(args)), "environment": report.environment(0), **result}
    for path in report.write("tool_calls", data, md):
        print("wrote", path.relative_to(report.REPORTS.parent.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
