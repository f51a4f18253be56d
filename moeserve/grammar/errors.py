"""The one error type of the grammar layer.

Everything a client can get wrong about a grammar (malformed request fields, an invalid or
unsupported JSON schema, a regex or EBNF that does not parse, a grammar too large or too slow
to compile) raises `GrammarError`. It subclasses `ValueError` so callers that only know
"bad input" still catch it; the gateway maps it to HTTP 400 / gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar the server will not run, with a message fit to show the client.

    `feature` names the refused JSON-Schema keyword or grammar feature when there is one
    (e.g. "uniqueItems", "format:iri", "oneOf"), so reports and metrics can count refusals
    by cause without parsing messages.
    """

    def __init__(self, message: str, *, feature: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.feature = feature

    def __reduce__(self):  # keep `feature` when the error crosses a process boundary
        return (_rebuild, (self.message, self.feature, type(self)))


class GrammarTimeoutError(GrammarError):
    """Compiling took longer than the configured limit (not cached: a retry may succeed)."""


def _rebuild(message: str, feature: str | None, cls: type[GrammarError]) -> GrammarError:
    return cls(message, feature=feature)
