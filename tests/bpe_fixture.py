"""A small byte-level BPE tokenizer with multi-byte characters, trained in well under a second.

The vocabulary is small on purpose: "₹" (3 bytes), "é" (2), "मावा" (12) and "🥐" (4) end
up split across several tokens, which is what the incremental detokenizer must handle.
The chat markers match the demo tokenizer's.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

_PHRASES = (
    "One mawa cake costs ₹120 and the croissant 🥐 costs ₹45.",
    "Café crème brûlée, s'il vous plaît — très bien.",
    "मावा केक और चाय, कृपया। मावा बहुत अच्छा है।",
    "Your order #1042 is ready: 2 × sourdough, 1 × éclair.",
    "パンとケーキ、ありがとうございます。",
    '{"item": "mawa cake", "price_inr": 120, "note": "naïve résumé"}',
    "Hello! How can I help you today?",
)


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(_PHRASES, 3)) for _ in range(n)]


def build_tokenizer(vocab_size: int = 420) -> PreTrainedTokenizerFast:
    """Train the tokenizer in memory and wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(folder: Path, chat_template: str | None = None) -> Path:
    """Save a freshly trained tokenizer in the Hugging Face format; returns the folder."""
    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return folder
