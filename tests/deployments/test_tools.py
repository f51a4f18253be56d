"""Tool calling without a model: which grammar each tool_choice needs, how text becomes calls
(whole or streamed), and how a conversation with tools reaches the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.tiny_tokenizer import build_tiny_tokenizer
from deployments.tools import Tool, ToolCalling
from moeserve.tokenizer import hermes_call, render_chat

PARAMS = {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": PARAMS}})
         for n in ("get_price", "place_order")]


NAMED = {"type": "function", "function": {"name": "place_order"}}


def test_each_tool_choice_sets_the_grammar():
    assert ToolCalling(TOOLS, None, True).grammar() is None  # auto: free text
    none = ToolCalling(TOOLS, "none", True)
    assert none.mode == "none" and none.grammar() is None and none.template_tools() == []  # not in the prompt
    text = 'Sure. <tool_call>{"name": "get_price", "arguments": {"item": "rye"}}</tool_call> Bye.'
    assert none.split(text) == ("Sure.  Bye.", [])  # a call written anyway is dropped, never content
    stream = none.stream()
    shown = "".join(stream.feed(text[i : i + 4]) for i in range(0, len(text), 4))
    assert "<tool" not in shown and stream.finish() == (" Bye.", [])
    # a named function: one call object with that name (parallel or not), so exactly one call
    named = json.loads(ToolCalling(TOOLS, NAMED, True).grammar().value)
    jsonschema.validate({"name": "place_order", "arguments": {"item": "rye"}}, named)
    for bad in ({"name": "get_price", "arguments": {"item": "rye"}}, [{"name": "place_order", "arguments": {"item": "a"}}],
                {"name": "place_order", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    one = json.loads(ToolCalling(TOOLS, "required", False).grammar().value)
    jsonschema.validate({"name": "get_price", "arguments": {"item": "rye"}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_price", "arguments": {"item": "rye"}}], one)  # not parallel: one call
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
    assert forced.split('[{"name":"get_pr') == (None, [])  # cut before the name is whole: no call, no content

    content, calls = ToolCalling(TOOLS, NAMED, True).split('{"name": "place_order", "arguments": {"item": "rye"}}')
    assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "place_order"
    assert json.loads(calls[0]["function"]["arguments"]) == {"item": "rye"}

    auto = ToolCalling(TOOLS, "auto", False)
    text = 'Let me check. <tool_call>{"name": "get_price", "arguments": {"item": "rye"}}</tool_call>' \
           '<tool_call>{"name": "place_order", "arguments": {"item": "rye"}}</tool_call>'
    content, calls = auto.split(text)
    assert content == "Let me check." and len(calls) == 1  # parallel_tool_calls false: the first
    assert ToolCalling(TOOLS, "auto", True).split(text)[1][1]["function"]["name"] == "place_order"
    assert auto.split("<tool_call>{not json}</tool_call> hi") == ("hi", [])  # no call, and no call syntax
    assert auto.split('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>') == (None, [])


def _cut_everywhere(calling: ToolCalling, full: str, expected: list[tuple[str, str]]):
    """Every prefix of `full`, whole and streamed in pieces: never call syntax in the content, and
    each call is one of `expected` (name, arguments text) with its arguments a prefix of theirs."""
    for end in range(len(full) + 1):
        text = full[:end]
        stream = calling.stream()
        shown = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
        rest, streamed = stream.finish()
        for content, calls in (calling.split(text), (shown + rest, streamed)):
            assert "<tool_call" not in (content or "") and "</tool_call>" not in (content or ""), text
            assert len(calls) <= len(expected)
            for call, (name, args) in zip(calls, expected):
                assert call["function"]["name"] == name
                assert args.startswith(call["function"]["arguments"]) or (
                    json.loads(call["function"]["arguments"]) == json.loads(args)), (text, call)
        yield text, calling.split(text)[1]


def test_a_call_cut_short_is_still_a_call_with_the_arguments_so_far():
    args = ['{"item": "rye \\"dark\\" loaf"}', '{"item": "b"}']
    required = "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}'
                               for n, a in zip(["get_price", "place_order"], args)) + "]"
    cuts = dict(_cut_everywhere(ToolCalling(TOOLS, "required", True), required,
                                [("get_price", args[0]), ("place_order", args[1])]))
    assert len(cuts[required]) == 2 and json.loads(cuts[required][0]["function"]["arguments"])["item"] == \
        'rye "dark" loaf'
    mid = required[: required.index("dark")]
    assert [c["function"]["arguments"] for c in cuts[mid]] == ['{"item": "rye \\"']

    whole = f'{{"name": "place_order", "arguments": {args[1]}}}'
    named = dict(_cut_everywhere(ToolCalling(TOOLS, NAMED, True), whole, [("place_order", args[1])]))
    assert all(len(calls) == 1 for calls in named.values())  # a named call exists from the first token on

    auto = "Sure. " + "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>'
                              for n, a in zip(["get_price", "place_order"], args))
    cuts = dict(_cut_everywhere(ToolCalling(TOOLS, "auto", True), auto,
                                [("get_price", args[0]), ("place_order", args[1])]))
    assert len(cuts[auto]) == 2 and len(cuts[auto[:-20]]) == 2
    assert ToolCalling(TOOLS, "auto", True).split(auto[:-20])[0] == "Sure."


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


def test_a_forced_call_begins_in_the_prompt_of_a_template_without_tools():
    """A forced single call (named, or required without parallel calls): the prompt ends with the
    call's tag and the grammar writes the call object, so prompt + reply reads as a trained Hermes
    call; a template that knows tools has its own syntax, so there the grammar alone forces the call."""
    messages = [{"role": "user", "content": "rye?"}]
    tools = [t.model_dump() for t in TOOLS]
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    named = ToolCalling(TOOLS, NAMED, True)
    prompt = render_chat(tok, messages, tools=tools, call_prefix=named.call_prefix())
    assert prompt.endswith("<|assistant|>\n<tool_call>")
    reply = '{"name": "place_order", "arguments": {"item": "rye"}}'
    assert (prompt + reply + "</tool_call>").endswith(hermes_call("place_order", '{"item": "rye"}'))
    assert named.split(reply)[1][0]["function"] == {"name": "place_order", "arguments": '{"item": "rye"}'}
    assert render_chat(tok, messages, tools=tools, call_prefix=ToolCalling(TOOLS, "required", False).call_prefix()
                       ).endswith("<|assistant|>\n<tool_call>")
    for unforced in (ToolCalling(TOOLS, "required", True), ToolCalling(TOOLS, "auto", True)):
        assert unforced.call_prefix() == ""
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render_chat(tok, messages, tools=tools, call_prefix=named.call_prefix()) == "[get_price][place_order]rye?"
    tok.chat_template = None  # no generation prompt: nothing of the reply either
    assert not render_chat(tok, messages, add_generation_prompt=False, tools=tools,
                           call_prefix=named.call_prefix()).endswith("<tool_call>")
