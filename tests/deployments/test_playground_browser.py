"""The playground in a real browser (Debian's chromium driven by Playwright): the page loads from
the gateway, a prompt streams tokens coloured by their experts, switching the layer and the
colouring changes what is shown, and a JSON schema gives an answer that validates."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from bench.serve_app import gateway_in_thread
from bench.tiny_checkpoint import MODEL_NAME, save_tiny_checkpoint
from model_shards import load_checkpoint
from moeserve.engine import LLMEngine, SpecConfig
from moeserve.engine.model_runner import ModelRunner
from moeserve.spec.ngram import NgramProposer
from moeserve.tokenizer import load_tokenizer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is installed by scripts/setup.sh")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup.sh installs Debian's)")
SCHEMA = {"type": "object", "properties": {"item": {"type": "string", "maxLength": 8},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["item", "qty"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"))
    engine = LLMEngine(ModelRunner(load_checkpoint(folder), 4, 256, num_blocks=128), load_tokenizer(folder),
                       proposer=NgramProposer(), spec=SpecConfig(num_tokens=3))
    with gateway_in_thread(engine, MODEL_NAME, str(folder), 256) as base:
        yield base


@pytest.fixture(scope="module")
def page(url):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{url}/playground")
        yield page
        browser.close()


def send(page, prompt: str, schema: dict | None = None) -> None:
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", "24")
    page.fill("#schema", json.dumps(schema) if schema else "")
    page.click("#send")
    page.wait_for_function("document.getElementById('status').textContent.includes('tokens in')", timeout=60_000)


def test_tokens_arrive_coloured_by_expert_and_by_source(page):
    assert page.text_content("#model") == f"model: {MODEL_NAME}"
    send(page, "Do you have rye bread today?")
    tokens = page.locator("#output span.tok")
    assert tokens.count() > 0
    first = [tokens.nth(i).get_attribute("data-expert") for i in range(tokens.count())]
    assert all(e is not None for e in first)  # every decoded token has its layer's top expert
    layers = page.locator("#layer option")
    assert layers.count() >= 2
    page.select_option("#layer", index=layers.count() - 1)
    last = [tokens.nth(i).get_attribute("data-expert") for i in range(tokens.count())]
    assert last != first  # another layer routes differently
    assert "layer" in tokens.first.get_attribute("title")  # hover: experts and gate weights
    page.select_option("#colour", "source")
    sources = {tokens.nth(i).get_attribute("data-source") for i in range(tokens.count())}
    assert sources <= {"target", "draft"} and "target" in sources
    assert page.locator("#legend span").first.text_content() == "target"


def test_a_schema_gives_valid_json(page):
    send(page, "I want two muffins, afternoon pickup.", SCHEMA)
    assert page.locator("#json .ok").text_content() == "valid JSON"
    jsonschema.validate(json.loads(page.text_content("#json pre")), SCHEMA)
    assert page.locator("#output span.forced").count() > 0  # the grammar forced the keys


def test_a_system_prompt_goes_before_the_prompt(page):
    page.fill("#system", "You are Crumb's order API.")
    try:
        with page.expect_request("**/v1/chat/completions") as request:
            send(page, "Status of ORD-482913?")
    finally:
        page.fill("#system", "")
    assert json.loads(request.value.post_data)["messages"] == [
        {"role": "system", "content": "You are Crumb's order API."}, {"role": "user", "content": "Status of ORD-482913?"}]
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Hi")
    assert json.loads(request.value.post_data)["messages"] == [{"role": "user", "content": "Hi"}]
