"""The demo corpus is deterministic per split, well-formed, and varied."""

import json
from collections import Counter

import pytest

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
