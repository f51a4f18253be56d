"""The demo tokenizer round-trips text exactly, keeps special tokens whole, and renders the chat template."""

import itertools
import json

import pytest
from transformers import AutoTokenizer

from demo.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS, render
from demo.corpus import corpus_text
from demo.tokenizer import save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(vocab_size=512, n_docs=300), folder)
    return AutoTokenizer.from_pretrained(folder)


def test_saved_config_holds_template_and_special_tokens(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 0


@pytest.mark.parametrize("text", [
    "Namaste, where is my order ORD-482913? It was ₹1,250.",
    json.dumps({"order_id": "ORD-100200", "items": [{"sku": "CRB-101", "qty": 2, "unit_price": 950}]}, indent=2),
    "  leading spaces,\ttabs\nand émojis 🎂 and Devanagari नमस्ते",
    "<|system|>\nYou help.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|endoftext|>",
])
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_round_trip_corpus(tokenizer):
    for doc in corpus_text("heldout", 50):
        assert tokenizer.decode(tokenizer.encode(doc)) == doc


def test_special_tokens_are_single_ids(tokenizer):
    for tok in SPECIAL_TOKENS:
        assert len(tokenizer.encode(tok)) == 1


def test_no_tokens_added_implicitly(tokenizer):
    assert tokenizer.decode(tokenizer.encode("Hi")) == "Hi"


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "You are Crumb's assistant."},
                {"role": "user", "content": "Is the Mawa cake eggless?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == render(messages, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == text


def test_packed_rows_start_at_a_document_and_hold_whole_documents(tokenizer):
    from demo.corpus import iter_documents
    from demo.train import packed_batches

    docs = iter_documents("train")
    expected = [tokenizer.encode(next(docs).text) for _ in range(200)]
    assert max(map(len, expected)) <= 1024  # this small vocabulary's documents all fit a row
    rows = [row.tolist() for batch in itertools.islice(packed_batches(tokenizer, "train", 4, 1024), 5) for row in batch]
    i = 0  # the next document the stream should show
    for row in rows:
        at = 0
        while at < len(row):
            doc = expected[i]
            piece = row[at:at + len(doc)]
            assert piece == doc[:len(piece)]  # every document starts where a row or the document before it ends
            if len(piece) < len(doc):  # the row's tail: the next row starts this document again
                assert at + len(piece) == len(row)
                break
            at, i = at + len(doc), i + 1
    assert i > 20
