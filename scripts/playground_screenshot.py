"""Take the README's playground screenshot (docs/playground.png) on the demo pair.

    python scripts/playground_screenshot.py [--out docs/playground.png]

Serves the demo pair in this process (gateway + engine, the draft model in-process), opens
/playground in Debian's chromium (Playwright), asks the demo's question (the order record in
the system prompt, the answer bound by the demo's JSON schema), waits for the answer and the
live panels, colours the tokens by their experts at the last layer, and saves the page.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from playwright.sync_api import sync_playwright

from bench.serve_app import gateway_in_thread
from deployments.local import DEMO_MESSAGES, DEMO_SCHEMA
from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, SpecConfig
from moeserve.engine.draft_model import DraftModelProposer
from moeserve.engine.factory import demo_checkpoint
from moeserve.engine.model_runner import ModelRunner
from moeserve.tokenizer import load_tokenizer


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
