"""The vocabulary as the grammar sees it: xgrammar `TokenizerInfo` built from a transformers tokenizer.

Blanked (never allowed) over `xgr.TokenizerInfo.from_huggingface`: special tokens (the detokenizer
drops their text), tokens that cannot occur in valid UTF-8, and for JSON grammars tokens with a raw
control byte (xgrammar 0.2.9's `minLength`/`maxLength` strings admit them, `json.loads` does not).
"""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from moeserve.grammar.utf8 import is_valid_fragment


def build_tokenizer_info(tokenizer: PreTrainedTokenizerBase, *, vocab_size: int | None = None,
                         stop_token_ids: Sequence[int] | None = None,
                         forbid_control_bytes: bool = False) -> xgr.TokenizerInfo:
    """TokenizerInfo over `vocab_size` ids (the model's, which may exceed len(tokenizer))."""
    stop = list(stop_token_ids) if stop_token_ids is not None else _default_stop_ids(tokenizer)
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    size = base.vocab_size
    special = _special_ids(tokenizer)
    encoded = [""] * size
    for token, idx in tokenizer.get_vocab().items():
        if idx < size and idx not in special:
            encoded[idx] = token
    for idx, text in enumerate(base.decoded_vocab):
        if idx not in stop and (not is_valid_fragment(text) or (forbid_control_bytes and any(b < 0x20 for b in text))):
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, base.vocab_type, vocab_size=size, stop_token_ids=stop,
                             add_prefix_space=base.add_prefix_space)


def _default_stop_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; pass stop_token_ids")
    return [tokenizer.eos_token_id]


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
