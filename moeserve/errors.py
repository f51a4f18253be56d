"""The one error vocabulary of the serving path: `ErrorCode` (gRPC's names) and the `ServingError`
carrying it; the engine's in-band `StreamError` carries the same codes."""

from __future__ import annotations

import enum
import re


class ErrorCode(str, enum.Enum):
    """Why a request failed."""

    INVALID_ARGUMENT = "invalid_argument"  # the request itself is bad; the message names the field
    NOT_FOUND = "not_found"  # an unknown model (or HTTP route)
    UNAUTHENTICATED = "unauthenticated"  # no valid API key
    RATE_LIMITED = "rate_limited"  # this API key holds its concurrent-request limit already
    TOO_LARGE = "too_large"  # the request body is over the limit
    RESOURCE_EXHAUSTED = "resource_exhausted"  # engine queue full: retry later
    UNAVAILABLE = "unavailable"  # engine stopped, failed or unreachable
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's timeout passed
    INTERNAL = "internal"  # a bug or an engine step error


class ServingError(Exception):
    """A failed request: its code, a message fit to show the client, the request field at fault
    (`param`) and, where there is a more precise one, OpenAI's error code string (`reason`)."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = ErrorCode(code), message, param
        self.reason = reason or self.code.value


# ValueErrors of SamplingParams, GrammarSpec, chat messages and tools start with the field's name.
_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*) ")


def as_serving_error(e: BaseException) -> ServingError:
    """Any exception as the ServingError a client gets: bad input (ValueError, GrammarError) is
    INVALID_ARGUMENT naming the field; anything unexpected is INTERNAL."""
    if isinstance(e, ServingError):
        return e
    if isinstance(e, ValueError):
        m = _LEADING_FIELD.match(str(e))
        return ServingError(ErrorCode.INVALID_ARGUMENT, str(e), param=m.group(1) if m else None)
    return ServingError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
