"""Take the README's playground screenshot (docs/playground.png) on the demo pair.

    python scripts/playground_screenshot.py [--out docs/playground.png]

Serves the demo pair in this process (gateway + engine, the draft model in-process), opens
/playground in Debian's chromium (Playwright), asks the demo's question (the order record in
the system prompt, the answer bound by the demo's JSON schema), waits for the answer and the
live panels, colours the tokens by their experts at the last layer, and saves the page.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

from playwright.sync_api import sync_playwright

from deployments.local import DEMO_MESSAGES, DEMO_SCHEMA
from model_shards import load_checkpoint
from moeserve.config import AppConfig
from moeserve.engine import LLMEngine, SpecConfig
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.engine.factory import demo_checkpoint
from moeserve.engine.model_runner import ModelRunner
from moeserve.tokenizer import load_tokenizer


@contextlib.contextmanager
def gateway_in_thread(engine: Any, model_name: str, model_path: str, max_model_len: int) -> Iterator[str]:
    """The gateway's HTTP app on a free local port (uvicorn on a thread) over `engine` (an LLMEngine,
    run by an in-process EngineServer); yields its base URL, stops both on exit."""
    import uvicorn

    from deployments.engine_server import EngineServer
    from deployments.gateway import Gateway
    from model_shards.local_group import free_port

    tree = AppConfig.from_dict({"model": {"name": model_name, "path": model_path},
                                "engine": {"max_model_len": max_model_len}, "gateway": {"grpc_port": None}})
    server = EngineServer(tree, engine=engine)
    gateway = Gateway(server, tree)
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(gateway.http_app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(10)
        server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/playground.png")
    args = ap.parse_args()
    target, draft = demo_checkpoint("demo-moe"), demo_checkpoint("demo-draft")
    engine = LLMEngine(ModelRunner(load_checkpoint(target), 4, 1024, num_blocks=512), load_tokenizer(target),
                       proposer=DraftModelProposer(load_checkpoint(draft), 4, 1024), spec=SpecConfig(num_tokens=4))
    with gateway_in_thread(engine, "demo-moe", target, 1024) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"),
                                    args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(f"{url}/playground")
        page.fill("#system", DEMO_MESSAGES[0]["content"])
        page.fill("#prompt", DEMO_MESSAGES[1]["content"])
        page.fill("#max_tokens", "96")
        page.fill("#schema", json.dumps(DEMO_SCHEMA))
        page.click("#send")
        page.wait_for_function("document.getElementById('status').textContent.includes('tokens in')", timeout=120_000)
        page.select_option("#layer", index=page.locator("#layer option").count() - 1)
        time.sleep(3)  # the live panels poll /metrics and /admin/experts
        page.screenshot(path=args.out, full_page=True)
        print(page.text_content("#json pre"))
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
