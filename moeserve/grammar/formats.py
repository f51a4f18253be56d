"""JSON-Schema `format`: which formats we enforce, and how (measured on xgrammar 0.2.9).
Formats no standard defines (int32, non-blank, ...) are annotations, so schema_node.py drops them.
"""

from __future__ import annotations

# Formats xgrammar turns into a grammar; the other standard formats it silently ignores.
SUPPORTED_FORMATS = frozenset(
    {
        "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid",
    }
)  # fmt: skip
UNSUPPORTED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference"})

# Formats whose xgrammar grammar lets invalid strings through (measured with random decodes against
# the oracle's checkers): dates like 2023-11-31, ipv4 with leading zeros (010.0.0.1, which
# validators reject as ambiguous octal), hostname labels over 63 characters. These patterns allow
# real calendar dates of years 0001-9999 (leap years included), times without leap seconds,
# canonical dotted quads, and hostnames of at most three labels (so at most 191 characters).
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
    r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29)"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
    "hostname": rf"^{_LABEL}(?:\.{_LABEL}){{0,2}}$",
    "regex": r"^[A-Za-z0-9 _-]*$",  # narrower: literal text, a valid regex in every dialect
}
