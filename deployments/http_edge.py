"""The gateway's HTTP edge: body size limit (413), errors in OpenAI's shape, request counts.

Every error leaves as `{"error": {"message", "type", "param", "code"}}`: APIError with its
status; pydantic validation errors and ValueErrors (SamplingParams, GrammarSpec and chat
validation, whose messages start with the field name) as 400; anything unexpected as a
logged 500 with a message, so bad input is never a bare 500 or a dropped connection.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.auth import ApiKeys
from deployments.metrics import GatewayMetrics
from deployments.openai_api import APIError

logger = logging.getLogger(__name__)


def install_edge(app: FastAPI, routes: Iterable[str], max_body_bytes: int, metrics: GatewayMetrics,
                 auth: ApiKeys | None = None, public_paths: Iterable[str] = ()) -> None:
    """Add the edge middleware and the error handlers to `app`."""
    app.add_middleware(_EdgeMiddleware, routes=frozenset(routes), max_body_bytes=max_body_bytes, metrics=metrics,
                       auth=auth or ApiKeys(from_env=False), public=frozenset(public_paths))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


# ---- errors --------------------------------------------------------------------------------------
def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None  # worth retrying: say when
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return _error_response(e)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "")
        return _error_response(APIError(400, f"request body is not valid JSON: {reason}".rstrip(": ")))
    problems, params = [], []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        params.append(loc)
        problems.append(f"{loc}: {err.get('msg', 'invalid')}")
    return _error_response(APIError(400, "invalid request: " + "; ".join(problems), param=params[0] if params else None))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (an unparseable body, an unknown route) in our shape."""
    return _error_response(APIError(e.status_code, str(e.detail)))


_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*) ")


async def _value_error(request: Request, e: ValueError) -> JSONResponse:
    """SamplingParams, GrammarSpec and chat validation start their messages with the field name."""
    m = _LEADING_FIELD.match(str(e))
    return _error_response(APIError(400, str(e), param=m.group(1) if m else None))


# ---- the edge: body size limit and request counts by route and code ----------------------------
class _EdgeMiddleware:
    """Pure ASGI (streamed responses pass through): 401 without a valid API key (when keys are
    configured; `public` paths stay open), 429 past a key's concurrent streams, 413 past
    max_body_bytes; an unexpected exception becomes a logged 500 with a message; every
    status is counted by route."""

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
                headers = dict(scope.get("headers", ()))
                key = self.auth.identify(headers.get(b"authorization", b"").decode("latin-1"))
                if key is None:
                    error = APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                                     code="invalid_api_key")
                    await _send_json(counting_send, 401, error.body(), [(b"www-authenticate", b"Bearer")])
                    return
                if not self.auth.acquire(key):
                    key = None
                    error = APIError(429, f"this API key already holds {self.auth.max_streams_per_key} requests; "
                                          "retry when one ends", code="rate_limit_exceeded")
                    await _send_json(counting_send, 429, error.body(), [(b"retry-after", b"1")])
                    return
            if scope.get("method") == "POST":
                body = await self._read_body(scope, receive)
                if body is None:
                    error = APIError(413, f"request body is larger than {self.limit} bytes", code="request_too_large")
                    await _send_json(counting_send, 413, error.body())
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, counting_send)
        except Exception as e:
            logger.exception("unexpected error on %s", scope.get("path"))
            if not status["code"]:
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal")
                await _send_json(counting_send, 500, error.body())
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


async def _send_json(send: Any, status: int, payload: dict, extra_headers: list | None = None) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += extra_headers or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})

