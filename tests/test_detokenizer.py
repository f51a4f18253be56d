"""Oracle tests: streamed text must equal a full decode, cut before the first stop string."""

import random

import pytest
from bpe_fixture import _PHRASES, build_tokenizer

from moeserve.tokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Push ids in random-sized groups (1-3, as speculative decoding would) until stopped."""
    chunks, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 3)
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.finish())
    return chunks


def reference_cut(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The output a client should see: text before the stop string that completes first."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, start, stop = min(hits, key=lambda h: (h[0], h[1]))
    return text[:start], stop


def real_text(rng: random.Random) -> str:
    return " ".join(rng.choice(_PHRASES) for _ in range(3))


def test_real_text_streams_whole_characters_only(tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        prompt = tokenizer.encode(real_text(rng), add_special_tokens=False)
        text = real_text(rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt, stop=())
        chunks = [detok.push([t]) for t in ids]
        chunks.append(detok.finish())
        assert "".join(chunks) == text
        assert not any(REPLACEMENT in c for c in chunks), chunks
        assert detok.text == text and not detok.stopped


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(stream(detok, ids, rng)) == expected, (prompt, ids)


def test_no_replacement_char_before_a_character_completes(tokenizer):
    # The small vocabulary splits "û", "î" and "—" over tokens: those steps return "".
    text = "crème brûlée, s'il vous plaît — très bien"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    out = [detok.push(t) for t in ids]
    assert "".join(out) + detok.finish() == text
    assert all(REPLACEMENT not in o for o in out)
    assert "" in out  # some token ended inside a character


def test_unfinished_character_is_flushed_as_full_decode_shows_it(tokenizer):
    ids = tokenizer.encode("₹", add_special_tokens=False)
    partial = ids[:-1] if len(ids) > 1 else [tokenizer.convert_tokens_to_ids("â")]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(partial) == ""
    assert detok.finish() == tokenizer.decode(partial) == REPLACEMENT


def test_stop_strings_cut_at_first_occurrence(tokenizer):
    rng = random.Random(2)
    stopped = 0
    for _ in range(300):
        text = real_text(rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                start = rng.randrange(len(text))
                stops.append(text[start : start + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["₹9999", "never here", "éé", "मावा!"]))
        stops = tuple(stops)
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        out = "".join(stream(detok, ids, rng))
        expected, reason = reference_cut(text, stops)
        assert out == expected, (text, stops)
        assert detok.stop_reason == reason and detok.stopped == (reason is not None)
        stopped += detok.stopped
    assert stopped > 150


def test_stop_strings_on_random_tokens(tokenizer):
    rng = random.Random(3)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = (full[rng.randrange(len(full)) :][:3],) if full else ("x",)
        if not stops[0]:
            continue
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        assert "".join(stream(detok, ids, rng)) == reference_cut(full, stops)[0], (ids, stops)


def test_holds_back_only_what_could_start_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("\n\nUser:", "₹0"))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert detok.push(enc("Hello")) == "Hello"
    assert detok.push(enc("\n\nUs")) == ""  # could be the start of "\n\nUser:"
    assert detok.push(enc("ed ₹")) == "\n\nUsed "  # no longer a prefix; "₹" might start "₹0"
    assert detok.push(enc("5")) == "₹5"
    assert detok.push(enc(" ok\n\nUser: more")) == " ok"
    assert detok.stopped and detok.stop_reason == "\n\nUser:"
    assert detok.push(enc("ignored")) == "" and detok.finish() == ""
    assert detok.text == "Hello\n\nUsed ₹5 ok"


def test_held_back_prefix_is_released_at_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("cake!",))
    assert detok.push(tokenizer.encode("mawa cak", add_special_tokens=False)) == "mawa "
    assert detok.finish() == "cak"
    assert not detok.stopped


def test_special_tokens_are_skipped_by_default(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [])
    text = detok.push(tokenizer.encode("Hello!", add_special_tokens=False) + [eos]) + detok.finish()
    assert text == "Hello!"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert detok.push([eos]) + detok.finish() == tokenizer.eos_token


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=("",))


class CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, tokenizer):
        self.inner = tokenizer.backend_tokenizer
        self.sizes: list[int] = []

    @property
    def backend_tokenizer(self):
        return self

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_a_small_window(tokenizer):
    rng = random.Random(4)
    text = " ".join(real_text(rng) for _ in range(60))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 1500
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Hi", add_special_tokens=False))
    out = "".join(detok.push(t) for t in ids) + detok.finish()
    assert out == text
    assert len(counting.sizes) <= 2 * len(ids) + 2
    assert max(counting.sizes) <= 8  # the longest character split, not the text length
