"""Which source files one chat request crosses: traced, not listed by hand.

    python -m bench.request_path [--draft none|ngram|model] [--schema] [--report]

Runs the gateway and an engine in this process (bench/serve_app.py's `gateway_in_thread`: the
same gateway, serving layer, engine replica and engine core as the served app; the Serve handle's
client is in gateway.py and the core's socket in core_client.py, both crossed here too), sends
one streamed chat request to warm every lazy path, then traces a second one: every function that
runs in the product packages, on any thread, from the request's arrival to its last byte. Prints
the files in the order the request first reached them.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moeserve", "model_shards", "router_service", "deployments")


class Tracer:
    """A profile hook on this thread and every thread started after `install` (the gateway's and the
    engine's); it records product files only while a request is being traced."""

    def __init__(self) -> None:
        self.roots = tuple(str(ROOT / p) + "/" for p in PACKAGES)
        self.seen: dict[str, None] | None = None

    def _profile(self, frame, event, arg) -> None:
        if self.seen is not None and event == "call" and frame.f_code.co_filename.startswith(self.roots):
            self.seen.setdefault(str(Path(frame.f_code.co_filename).relative_to(ROOT)), None)

    def install(self) -> None:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def files(self, url: str, body: dict) -> list[str]:
        """Product files whose code runs while `body` is posted to `url` (in first-reached order)."""
        import httpx

        self.seen = {}
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
        finally:
            seen, self.seen = self.seen, None
        return list(seen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="none", help="speculation: none | ngram | model")
    ap.add_argument("--schema", action="store_true", help="ask for JSON under the demo schema (structured output)")
    ap.add_argument("--report", action="store_true", help="write bench/reports/request_path.md")
    args = ap.parse_args(argv)

    from bench.serve_app import gateway_in_thread
    from deployments.local import DEMO_MESSAGES, DEMO_SCHEMA
    from moeserve.config import AppConfig, resolve_path
    from moeserve.engine.factory import build_engine

    tree = AppConfig.from_options(draft=args.draft)
    engine = build_engine(tree)
    body = {"model": tree.model.name, "messages": DEMO_MESSAGES, "stream": True, "max_tokens": 24}
    if args.schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": DEMO_SCHEMA}}
    tracer = Tracer()
    tracer.install()
    with gateway_in_thread(engine, tree.model.name, resolve_path(tree.model.path), tree.engine.max_model_len) as base:
        url = f"{base}/v1/chat/completions"
        tracer.files(url, body)  # warm-up: lazy imports, grammar compile, first-call paths
        files = tracer.files(url, body)
    text = "\n".join(f"{i:2d}. `{f}`" for i, f in enumerate(files, 1)) + f"\n\n{len(files)} files\n"
    print(text)
    if args.report:
        out = ROOT / "bench" / "reports" / "request_path.md"
        out.write_text(f"# Files one chat request crosses\n\n`python -m bench.request_path --draft {args.draft}`"
                       f" (traced, in first-reached order)\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
