"""Keeping outputs valid UTF-8, which xgrammar 0.2.9 does not fully do.

xgrammar checks the shape of UTF-8 sequences but not RFC 3629's value ranges, so it accepts
surrogates (`ED A0 80`) and, in patterns, overlong forms (`E0 80 80`); the client would then see
U+FFFD. Two guards: tokenizer_info.py blanks tokens whose own bytes are invalid, and when the
output ends in a lead E0, ED, F0 or F4, `GrammarMatcher` ANDs `second_byte_rows[lead]` into the mask.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

# RFC 3629: the second byte after these leads has a narrower range than 80-BF.
SECOND_BYTE_RANGE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _sequence_length(lead: int) -> int:
    """Bytes in the sequence a byte starts: 1 (ASCII), 2-4 (lead), 0 (continuation or invalid)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def is_valid_fragment(data: bytes) -> bool:
    """Can `data` appear as a token inside valid UTF-8? Leading continuation bytes (the end of
    a character begun by an earlier token) and a trailing unfinished character are fine."""
    i = 0
    while i < len(data) and 0x80 <= data[i] <= 0xBF and i < 3:
        i += 1
    while i < len(data):
        need = _sequence_length(data[i])
        if need == 0:
            return False
        tail = data[i + 1 : i + need]
        if any(not 0x80 <= b <= 0xBF for b in tail):
            return False
        if tail and data[i] in SECOND_BYTE_RANGE:
            lo, hi = SECOND_BYTE_RANGE[data[i]]
            if not lo <= tail[0] <= hi:
                return False
        i += need
    return True


def pending_lead(tail: bytes) -> int | None:
    """The E0/ED/F0/F4 lead whose range-restricted second byte comes next, if any."""
    return tail[-1] if tail and tail[-1] in SECOND_BYTE_RANGE else None


def second_byte_rows(decoded_vocab: list[bytes], vocab_size: int) -> dict[int, torch.Tensor]:
    """For each special lead, a bitmask row [W] of the tokens whose first byte may follow it."""
    rows = {}
    for lead, (lo, hi) in SECOND_BYTE_RANGE.items():
        row = xgr.allocate_token_bitmask(1, vocab_size)[0].zero_()  # [W]
        for t, text in enumerate(decoded_vocab):
            if text and lo <= text[0] <= hi:
                row[t // 32] |= 1 << (t % 32)
        rows[lead] = row
    return rows
