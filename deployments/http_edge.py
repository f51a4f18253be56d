"""The gateway's HTTP edge: ErrorCode -> HTTP status (once), errors in OpenAI's shape, API keys,
the body size limit (413) and request counts.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with its ErrorCode's
status; anything unexpected as a logged INTERNAL, never a bare 500.

API keys come from `gateway.api_keys` and MOESERVE_API_KEY (comma-separated); none configured:
open. Every key is compared in constant time, all of them every time. A key holds at most
`max_streams_per_key` requests at once; past it, RATE_LIMITED (429 + Retry-After).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.metrics import GatewayMetrics
from moeserve.config import GatewaySection
from moeserve.errors import ErrorCode, ServingError, as_serving_error

logger = logging.getLogger(__name__)

ENV_VAR = "MOESERVE_API_KEY"


class ApiKeys:
    def __init__(self, cfg: GatewaySection, from_env: bool = True) -> None:
        """cfg.api_keys (and $MOESERVE_API_KEY's when `from_env`); no key configured: open."""
        env = os.environ.get(ENV_VAR, "") if from_env else ""
        self.keys = tuple(k.strip() for k in (*cfg.api_keys, *env.split(",")) if k.strip())
        self.max_streams_per_key = cfg.max_streams_per_key
        self._streams: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None) -> str | None:
        """The key an `Authorization: Bearer KEY` value carries, if it is one of ours."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip().encode()
        found = None
        for key in self.keys:  # no early exit: every key is compared every time
            if hmac.compare_digest(token, key.encode()) and scheme.lower() == "bearer":
                found = key
        return found

    def admit(self, authorization: str | None, how: str) -> str:
        """The caller's key, holding one of its slots until `release`; else UNAUTHENTICATED (`how`:
        where to send one) or RATE_LIMITED."""
        key = self.identify(authorization)
        if key is None:
            raise ServingError(ErrorCode.UNAUTHENTICATED, f"missing or invalid API key ({how})",
                               reason="invalid_api_key")
        if not self.acquire(key):
            raise ServingError(ErrorCode.RATE_LIMITED, f"this API key already holds {self.max_streams_per_key} "
                               "requests; retry when one ends", reason="rate_limit_exceeded")
        return key

    def acquire(self, key: str) -> bool:
        """Take one of `key`'s stream slots; False when it holds its limit already."""
        if self.max_streams_per_key and self._streams[key] >= self.max_streams_per_key:
            return False
        self._streams[key] += 1
        return True

    def release(self, key: str) -> None:
        self._streams[key] -= 1
        if self._streams[key] <= 0:
            del self._streams[key]


HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.RESOURCE_EXHAUSTED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}
_MEANING = {
    400: "bad input; the message names the field", 401: "missing or invalid API key",
    404: "unknown model", 413: "request body too large", 429: "this API key's concurrent-request limit",
    500: "server error", 503: "engine queue full or engine unavailable (Retry-After)", 504: "request timed out",
}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the HTTP API returns, whatever its status (OpenAI's shape)."""

    error: ErrorBody


def error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    """FastAPI `responses=` documenting these error statuses with the error body's schema."""
    return {s: {"model": ErrorResponse, "description": _MEANING[s]} for s in statuses}


def error_body(e: ServingError, status: int | None = None) -> dict[str, Any]:
    """OpenAI's error body for `e` (`status`: the HTTP status, when not its code's)."""
    status = status or HTTP_STATUS[e.code]
    kind = _TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.reason}}


def install_edge(app: FastAPI, routes: Iterable[str], max_body_bytes: int, metrics: GatewayMetrics,
                 auth: ApiKeys | None = None, public_paths: Iterable[str] | None = None) -> None:
    """Add the edge middleware and the error handlers to `app`."""
    app.add_middleware(_EdgeMiddleware, routes=frozenset(routes), max_body_bytes=max_body_bytes, metrics=metrics,
                       auth=auth or ApiKeys(GatewaySection(), from_env=False), public=frozenset(public_paths or ()))
    app.add_exception_handler(ServingError, _serving_error)
    app.add_exception_handler(ValueError, _serving_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def _error_response(e: ServingError, status: int | None = None) -> JSONResponse:
    status = status or HTTP_STATUS[e.code]
    headers = {"Retry-After": "1"} if status in (429, 503) else None  # worth retrying: say when
    if e.code is ErrorCode.UNAUTHENTICATED:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(e, status), status_code=status, headers=headers)


async def _serving_error(request: Request, e: Exception) -> JSONResponse:
    return _error_response(as_serving_error(e))


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "")
        return _error_response(ServingError(ErrorCode.INVALID_ARGUMENT,
                                            f"request body is not valid JSON: {reason}".rstrip(": ")))
    problems, params = [], []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        params.append(loc)
        problems.append(f"{loc}: {err.get('msg', 'invalid')}")
    return _error_response(ServingError(ErrorCode.INVALID_ARGUMENT, "invalid request: " + "; ".join(problems),
                                        param=params[0] if params else None))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (an unknown route, a wrong method) in our shape, their status kept."""
    code = ErrorCode.NOT_FOUND if e.status_code == 404 else ErrorCode.INVALID_ARGUMENT
    return _error_response(ServingError(code, str(e.detail)), e.status_code)


# ---- the edge: body size limit and request counts by route and code ----------------------------
class _EdgeMiddleware:
    """Pure ASGI (streams pass through): 401 without a valid key (but `public` paths), 429 past a
    key's streams, 413 past max_body_bytes, a logged 500 for the unexpected; statuses counted by route."""

    def __init__(self, app: Any, routes: frozenset[str], max_body_bytes: int, metrics: GatewayMetrics,
                 auth: ApiKeys, public: frozenset[str]) -> None:
        self.app, self.routes, self.limit, self.metrics = app, routes, max_body_bytes, metrics
        self.auth, self.public = auth, public

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope.get("path", "") if scope.get("path") in self.routes else "other"  # bounded label values
        status = {"code": 0}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        key = None
        try:
            if self.auth.enabled and scope.get("path") not in self.public:
                authorization = dict(scope.get("headers", ())).get(b"authorization", b"").decode("latin-1")
                key = self.auth.admit(authorization, "send Authorization: Bearer KEY")
            if scope.get("method") == "POST":
                body = await self._read_body(scope, receive)
                if body is None:
                    raise ServingError(ErrorCode.TOO_LARGE, f"request body is larger than {self.limit} bytes",
                                       reason="request_too_large")
                receive = _replay(body, receive)
            await self.app(scope, receive, counting_send)
        except Exception as e:
            error = as_serving_error(e)
            if error.code is ErrorCode.INTERNAL:
                logger.exception("unexpected error on %s", scope.get("path"))
            if not status["code"]:
                await _error_response(error)(scope, receive, counting_send)
        finally:
            if key is not None:
                self.auth.release(key)
            self.metrics.requests.labels(route=route, code=str(status["code"])).inc()

    async def _read_body(self, scope: dict, receive: Any) -> bytes | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(parts)


def _replay(body: bytes, receive: Any) -> Any:
    """Hand the buffered body to the app once, then the real channel (which reports disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
