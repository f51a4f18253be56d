"""`moeserve` command line: `generate` streams a reply in this process; `serve` starts the app."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moeserve.config import AppConfig
from moeserve.engine.factory import speculation
from moeserve.engine.llm import LLM
from moeserve.sampling_params import SamplingParams, StructuredOutputsParams
from moeserve.tokenizer import render_chat


def _generate(args: argparse.Namespace) -> int:
    draft = args.draft if args.draft != "model" or not args.draft_model else args.draft_model
    try:
        structured = None
        if args.json_schema or args.regex:
            schema = Path(args.json_schema).read_text() if args.json_schema else None
            structured = StructuredOutputsParams(json=schema, regex=args.regex)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, structured_outputs=structured)
        llm = LLM(args.model, draft, num_tokens=args.num_spec_tokens, max_model_len=args.max_model_len,
                  max_num_seqs=1, compile=args.compile)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.raw else render_chat(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    t0 = time.perf_counter()
    n = 0
    try:
        for text, out in llm.stream(prompt, params):
            sys.stdout.write(text)
            sys.stdout.flush()
            n = len(out.token_ids)
    except ValueError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print()
    if args.verbose:
        stats = llm.engine.spec_metrics
        print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tokens/s; speculation={speculation(llm.config)}, "
              f"tokens per target pass {stats.tokens_per_pass:.2f}]", file=sys.stderr)
    return 0


def serve_config(args: argparse.Namespace) -> AppConfig:
    """The config tree `moeserve serve` runs: the --config file (or the defaults), then the flags."""
    overrides: dict = {"engine": {}}
    if args.shards is not None:
        overrides["shards"] = {"num_shards": args.shards}
    if args.draft is not None:
        overrides["speculative"] = {"draft": "model" if args.draft == "draft" else args.draft}
    if args.grpc_port is not None:
        overrides["gateway"] = {"grpc_port": args.grpc_port}
    if args.model is not None:
        overrides["model"] = {"path": args.model}
    for name in ("max_num_seqs", "max_model_len", "kv_cache_memory"):
        if getattr(args, name) is not None:
            overrides["engine"][name] = getattr(args, name)
    if args.api_key:
        overrides.setdefault("gateway", {})["api_keys"] = list(args.api_key)
    if args.config:
        return AppConfig.load(args.config, overrides)
    return AppConfig.from_dict(overrides)


def _serve(args: argparse.Namespace) -> int:
    """Deploy gateway + engine on an embedded local Ray; Ray is imported only here."""
    from deployments.local import serve_locally  # lazy: `moeserve generate` never loads Ray

    try:
        cfg = serve_config(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve_locally(cfg, host=args.host, http_port=args.http_port, num_cpus=args.num_cpus, demo=args.demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a reply to PROMPT with the demo models, streaming to the terminal")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--draft", choices=("model", "ngram", "none"), default="ngram",
                   help="speculative proposer: the demo draft model, prompt lookup (default), or none")
    g.add_argument("--num-spec-tokens", type=int, default=4)
    g.add_argument("--model", help="target checkpoint folder (default: checkpoints/demo-moe)")
    g.add_argument("--draft-model", help="draft checkpoint folder (default: checkpoints/demo-draft)")
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    g.add_argument("--compile", action="store_true",
                   help="compile the decode step first (pays off for long outputs; tens of seconds the first time)")
    g.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid under the schema in FILE")
    g.add_argument("--regex", help="the reply matches this regular expression (one of --json-schema, --regex)")
    g.add_argument("-v", "--verbose", action="store_true", help="print throughput and speculation stats")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="start the app (gateway + engine) on a local Ray; Ctrl-C stops it")
    s.add_argument("--config", help="YAML: an app config, or a Serve config (default: built-in defaults)")
    s.add_argument("--shards", type=int, help="expert-parallel shards per engine replica")
    s.add_argument("--draft", choices=("auto", "model", "ngram", "none", "draft"),
                   help="speculative proposer (default auto: the draft model if it shares the target's tokenizer)")
    s.add_argument("--model", help="target checkpoint folder (default: checkpoints/demo-moe)")
    s.add_argument("--max-num-seqs", type=int, help="running batch of one engine replica (engine.max_num_seqs)")
    s.add_argument("--max-model-len", type=int, help="context length, prompt and output (engine.max_model_len)")
    s.add_argument("--kv-cache-memory", metavar="BYTES",
                   help="KV cache of one engine replica, reserved at start, e.g. 2GiB (engine.kv_cache_memory)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="require this API key (repeatable; $MOESERVE_API_KEY adds comma-separated ones)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, help="gRPC port (default 9000; 0 turns gRPC off)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0 for all interfaces)")
    s.add_argument("--num-cpus", type=int, default=4, help="logical CPUs for the local Ray (default 4)")
    s.add_argument("--demo", action="store_true", help="once up, stream a JSON-schema-constrained demo reply")
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
