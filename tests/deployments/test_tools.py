"""Tool calling without a model: which grammar each tool_choice needs, how text becomes calls
(whole or streamed), and how a conversation with tools reaches the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.tiny_tokenizer import build_tiny_tokenizer
from deployments.tools import Tool, ToolCalling
from moeserve.tokenizer import render_chat

PARAMS = {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": PARAMS}})
         for n in ("get_price", "place_order")]


def test_each_tool_choice_sets_the_grammar():
    assert ToolCalling(TOOLS, None, True).grammar() is None  # auto: free text
    assert ToolCalling(TOOLS, "none", True).mode == "none"
    named = json.loads(ToolCalling(TOOLS, {"type": "function", "function": {"name": "place_order"}}, False)
                       .grammar().value)
    jsonschema.validate({"name": "place_order", "arguments": {"item": "rye"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_price", "arguments": {"item": "rye"}}, named)
    required = json.loads(ToolCalling(TOOLS, "required", True).grammar().value)
    jsonschema.validate([{"name": "get_price", "arguments": {"item": "a"}},
                         {"name": "place_order", "arguments": {"item": "b"}}], required)
    for bad in ([], [{"name": "get_price", "arguments": {}}], [{"name": "other", "arguments": {"item": "a"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


def test_forced_and_auto_text_become_calls():
    forced = ToolCalling(TOOLS, "required", True)
    content, calls = forced.split('[{"name":"get_price","arguments":{"item":"rye"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_price"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"item": "rye"}
    assert forced.split('[{"name":"get_pr') == ('[{"name":"get_pr', [])  # cut short: no call

    auto = ToolCalling(TOOLS, "auto", False)
    text = 'Let me check. <tool_call>{"name": "get_price", "arguments": {"item": "rye"}}</tool_call>' \
           '<tool_call>{"name": "place_order", "arguments": {"item": "rye"}}</tool_call>'
    content, calls = auto.split(text)
    assert content == "Let me check." and len(calls) == 1  # parallel_tool_calls false: the first
    assert auto.split("<tool_call>{not json}</tool_call> hi")[1] == []
    assert auto.split('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []


def test_streamed_auto_text_holds_back_a_possible_call():
    stream = ToolCalling(TOOLS, "auto", True).stream()
    pieces = ["Sure", ", one moment <tool", '_call>{"name": "get_price", ', '"arguments": {"item": "rye"}}</tool_call>']
    shown = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert shown == "Sure, one moment " and rest.strip() == "" and calls[0]["function"]["name"] == "get_price"
    plain = ToolCalling(TOOLS, "auto", True).stream()
    shown = "".join(plain.feed(p) for p in ["a <", "b"])  # "<" might have started a call, then did not
    assert shown + plain.finish()[0] == "a <b" and plain.finish()[1] == []


def test_tools_reach_the_chat_template_natively_or_in_plain_roles():
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_price", "arguments": '{"item": "rye"}'}}]
    messages = [{"role": "user", "content": "rye?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "120"}]
    tools = [t.model_dump() for t in TOOLS]
    tok = build_tiny_tokenizer()
    tok.chat_template = None  # moeserve's default template: plain roles only
    plain = render_chat(tok, messages, tools=tools)
    assert plain.startswith("<|system|>\nYou can call these functions") and '"name": "place_order"' in plain
    assert '<tool_call>{"name": "get_price", "arguments": {"item": "rye"}}</tool_call>' in plain
    assert "<|user|>\n<tool_response>\n120\n</tool_response>" in plain
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                         "call {{ c.function.name }}{% endfor %};{% endfor %}")
    native = render_chat(tok, messages, tools=tools, add_generation_prompt=False)
    assert native == "[get_price][place_order]user:rye?;assistant:call get_price;tool:120;"
