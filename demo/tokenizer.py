"""Byte-level BPE tokenizer for the demo pair, trained with `tokenizers` and saved in HF format.

Digits are split one per token before BPE, so order ids and prices are spelled digit by digit:
a small model can then copy an id from the prompt instead of having to know ``"4821"`` as a unit.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from demo.chat_format import CHAT_TEMPLATE, EOS, SPECIAL_TOKENS
from demo.corpus import corpus_text


def train_tokenizer(vocab_size: int = 2048, n_docs: int = 4000) -> PreTrainedTokenizerFast:
    """Train on the first ``n_docs`` train-split documents and wrap for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text("train", n_docs), trainer=trainer)
    return _wrap(tok)


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer a saved demo checkpoint uses (its tokenizer.json), wrapped as train_tokenizer wraps it."""
    return _wrap(Tokenizer.from_file(str(Path(folder) / "tokenizer.json")))


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS],
        clean_up_tokenization_spaces=False,  # exact round trips: decode(encode(x)) == x
        model_max_length=1024,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into ``folder``."""
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)  # template inside tokenizer_config.json
