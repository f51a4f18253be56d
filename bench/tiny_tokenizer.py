"""A small byte-level BPE tokenizer for grammar tests, trained in about a second.

The grammar layer must not depend on the demo checkpoint, so its tests (and
`bench/grammar_conformance.py` when no tokenizer path is given) train this one: byte-level
BPE over JSON records and English sentences, ~1000 tokens, every byte reachable, with an
EOS token. Byte-level matters: it is what GPT-2/Llama-3/Qwen tokenizers are, and its
multi-character tokens (`{"`, `":"`, ` the`) are exactly what makes grammar masking subtle.
"""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MODEL_VOCAB = 1024  # the grammar tests' model: lm_head padded past the 1000 tokens, as real models often are

_WORDS = (
    "the bakery sells bread and cakes every morning customer order total price name email "
    "date quantity item status shipped delivered pending address city street phone note "
    "true false null id type value description items list count a an of to in is for with "
    "please thank you hello my your we our can will would like want sourdough croissant "
    "baguette muffin cookie chocolate vanilla apple cinnamon small large medium tomorrow today"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", "."])


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["str", "int", "float", "bool", "null", "obj", "arr"] if depth < 3 else ["str", "int", "bool"])
    if kind == "str":
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
    if kind == "int":
        return rng.randint(-1000, 100000)
    if kind == "float":
        return round(rng.uniform(-100, 1000), rng.randint(1, 3))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "obj":
        return {rng.choice(_WORDS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def training_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic mix of compact and spaced JSON documents and English sentences."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if i % 2 == 0:
            doc = {rng.choice(_WORDS): _json_value(rng) for _ in range(rng.randint(1, 5))}
            separators = (",", ":") if i % 4 == 0 else (", ", ": ")
            lines.append(json.dumps(doc, separators=separators))
        else:
            lines.append(_sentence(rng))
    return lines


def build_tiny_tokenizer(vocab_size: int = 1000, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE and wrap it as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays reachable
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
