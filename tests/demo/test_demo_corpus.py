"""The demo corpus is deterministic per split, well-formed, and varied."""

import json
import re
from collections import Counter

import pytest

from demo.bakery import FIRST_NAMES
from demo.chat_format import EOS, render
from demo.corpus import corpus_text, iter_documents, kind_weights


def test_same_split_same_text():
    assert corpus_text("train", 50) == corpus_text("train", 50)


def test_splits_differ():
    train, heldout = corpus_text("train", 200), corpus_text("heldout", 200)
    assert train != heldout
    assert len(set(train) & set(heldout)) < 10  # a few short FAQ chats may coincide; most must not


def test_documents_are_well_formed():
    it = iter_documents("train")
    kinds = set()
    for _ in range(400):
        sample = next(it)
        kinds.add(sample.kind)
        assert sample.text.endswith(EOS) and sample.text.count(EOS) == 1
        if sample.messages is None:
            record = json.loads(sample.text.removesuffix(EOS))
            assert {"order_id", "customer", "items", "total", "currency", "status", "delivery"} <= record.keys()
            assert record["total"] >= sum(i["qty"] * i["unit_price"] for i in record["items"])
        else:
            assert sample.text == render(sample.messages) + EOS
            assert sample.messages[-1]["role"] == "assistant"
            if sample.kind == "json_answer":
                reply = json.loads(sample.messages[-1]["content"])
                if "customer" in reply:  # a new order: no total or fee, which are the shop's arithmetic
                    assert "total" not in reply and "fee" not in reply["delivery"] and reply["status"] == "placed"
    assert {"order_status", "allergens", "price", "opening_hours", "custom_cake", "refund", "delivery", "json_answer",
            "order_record"} <= kinds


def test_variety():
    docs = corpus_text("train", 1000)
    assert len(set(docs)) > 950


def test_kind_weights_shift_the_mix_and_refuse_unknown_kinds():
    plain, focused = iter_documents("train"), iter_documents("train", weights=kind_weights({"price": 5.0}))
    default = Counter(next(plain).kind for _ in range(2000))
    shifted = Counter(next(focused).kind for _ in range(2000))
    assert default["price"] / 2000 < 0.15 and shifted["price"] / 2000 > 0.7  # 5 / (5 + 0.90 + 0.15) = 0.83
    with pytest.raises(ValueError, match="unknown document kinds"):
        kind_weights({"pricing": 1.0})


def test_tool_call_chats_render_as_a_server_renders_them_and_call_with_the_asks_arguments():
    """A tool-call chat is the conversation a client sends (tools, tool_calls, tool results) in the
    demo template's Hermes rewrite; its call's arguments validate against the function and come from
    the ask; and a named tool_choice's prompt (`call_prefix`) + the arguments is the trained text."""
    import jsonschema

    from demo.bakery import PRODUCTS
    from demo.corpus import TOOLS, tool_call_args
    from moeserve.tokenizer import hermes_call, in_plain_roles, load_tokenizer, render_chat

    tokenizer = load_tokenizer("checkpoints/demo-moe")
    chats = (s for s in iter_documents("heldout") if s.kind == "tool_call")
    called = Counter()
    for sample in (next(chats) for _ in range(120)):
        assert sample.text == render(in_plain_roles(sample.openai_messages, sample.tools)) + EOS
        listed = [t["function"]["name"] for t in sample.tools]
        if (call := tool_call_args(sample.openai_messages)) is None:  # answered in text
            assert "<tool_call>" not in sample.text.split("</tools>")[-1]
            continue
        name, args = call
        called[name] += 1
        assert name in listed
        jsonschema.validate(args, TOOLS[name]["function"]["parameters"])
        ask = next(m["content"] for m in sample.openai_messages if m["role"] == "user")
        if name == "place_order":
            assert args["item"] in {p.name for p in PRODUCTS} and args["pickup"] in ask
        else:
            assert next(iter(args.values())) in ask  # the order id or pin, copied
        asked = sample.openai_messages[: next(i for i, m in enumerate(sample.openai_messages) if m.get("tool_calls"))]
        prompt = render_chat(tokenizer, asked, tools=sample.tools, call_prefix=hermes_call(name))
        assert sample.text.startswith(prompt + " " + json.dumps(args) + "}</tool_call><|end|>")
    assert min(called.values()) >= 5 and set(called) == set(TOOLS)


def test_names_and_new_orders_are_written_where_a_reply_copies_them():
    """An order-status chat gives the customer's name as the reply writes it; a new order quotes the
    name and the items as the JSON reply writes them."""
    seen = set()
    for sample in iter_documents("heldout"):
        if sample.kind == "order_status" and "order_status" not in seen:
            system, reply = sample.messages[0]["content"], sample.messages[2]["content"]
            customer = json.loads(system.split("Order record: ")[1])["customer"]
            assert f"\nCustomer: {customer}\n" in system and reply.startswith(f"Hi {customer.split()[0]}!")
            seen.add("order_status")
        elif sample.kind == "json_answer" and "customer" in (reply := json.loads(sample.messages[-1]["content"])):
            ask = sample.messages[1]["content"]
            assert f'"{reply["customer"]}"' in ask and all(f'{i["qty"]} x "{i["name"]}"' in ask for i in reply["items"])
            seen.add("new_order")
        if len(seen) == 2:
            break


def test_name_chats_greet_by_the_name_the_prompt_gives_and_stay_out_of_the_default_mix():
    assert kind_weights()["names"] == 0  # the held-out stream earlier pairs were measured on is unchanged
    heldout = iter_documents("heldout")
    assert not any(next(heldout).kind == "names" for _ in range(1000))
    names = iter_documents("train", weights={"names": 1.0})
    where = Counter()
    for sample in (next(names) for _ in range(40)):
        first_turn = sample.messages[0]["content"]
        replies = [m["content"] for m in sample.messages if m["role"] == "assistant"]
        first = replies[0].split("!")[0].removeprefix("Hi ")
        assert first in FIRST_NAMES and re.search(rf"\b{first} [A-Z]", first_turn), (first, first_turn)
        assert all(r == f"You're welcome, {first}! Have a sweet day." for r in replies[1:])
        where[sample.messages[0]["role"]] += 1
    assert where["system"] >= 10 and where["user"] >= 10
