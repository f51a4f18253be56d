"""The one error type of the grammar layer: whatever a client can get wrong about a grammar.
A `ValueError`, so callers that only know "bad input" catch it; the gateway maps it to HTTP 400.
"""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar the server will not run, with a message fit to show the client. `feature` names
    the refused keyword or feature ("uniqueItems", "format:iri"), so refusals can be counted by cause."""

    def __init__(self, message: str, *, feature: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.feature = feature

    def __reduce__(self):  # keep `feature` when the error crosses a process boundary
        return (_rebuild, (self.message, self.feature, type(self)))

    @classmethod
    def refused(cls, feature: str, why: str) -> GrammarError:
        """A refusal of `feature`, its message led by the feature's name."""
        return cls(f"{feature}: {why}", feature=feature)

    def refusal(self, kind: str) -> str:
        """What the client reads (the served 400 and the offline API alike): the message, naming the grammar kind."""
        return self.message if self.message.startswith("invalid") else f"invalid {kind} grammar: {self.message}"


class GrammarTimeoutError(GrammarError):
    """Compiling took longer than the configured limit (not cached: a retry may succeed)."""


def _rebuild(message: str, feature: str | None, cls: type[GrammarError]) -> GrammarError:
    return cls(message, feature=feature)
