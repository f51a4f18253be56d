"""The chaos client: one streamed chat attempt, and the retry rule the README states.

The rule is the official OpenAI Python SDK's (openai-python `_base_client.py`,
`_should_retry` and `_calculate_retry_timeout`), plus one addition for streams:

- retried: a connection error or timeout; HTTP 408, 409, 429 and every status >= 500; a
  response header `x-should-retry: true` forces a retry of any status, `false` forbids one;
- at most MAX_RETRIES retries (3 attempts in all);
- the wait before retry n (n = 0, 1): the response's Retry-After (`retry-after-ms`, else
  `retry-after` in seconds or as an HTTP date) when it is > 0 and <= 120 s; else
  min(0.5 * 2**n, 8) s times a jitter factor drawn uniformly from (0.75, 1];
- a Retry-After above 120 s means no retry;
- the addition: a stream that breaks after its 200 (the connection drops, or the body ends
  without `data: [DONE]`) is retried as a connection error, under the same budget. The SDK
  retries only until the response starts; a client streaming through a dying gateway replica
  has to add this itself. The retry asks again from scratch (a new completion).

Not retried: any other status, an error event inside the stream (the server's answer), a
malformed stream. Plain `requests`: the locust user runs this code under gevent, the unit
tests against a local server.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import requests

from bench.locust.chaos_ledger import Ledger

MAX_RETRIES = 2
INITIAL_DELAY_S, MAX_DELAY_S = 0.5, 8.0
MAX_RETRY_AFTER_S = 120.0
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 5.0, 90.0  # read: the longest silence before the attempt is a timeout
RETRY_STATUSES = (408, 409, 429)  # and every status >= 500


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asks to wait: retry-after-ms, else retry-after (seconds or an HTTP date)."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return float(value) / divisor
            except ValueError:
                pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_tz(value)
        return None if when is None else email.utils.mktime_tz(when) - time.time()
    except (TypeError, ValueError, OverflowError):
        return None


def should_retry(attempt: Mapping[str, Any]) -> bool:
    """Is this failed attempt worth another under the rule (the budget aside)?"""
    outcome = attempt["outcome"]
    if outcome.startswith("conn:"):
        return True
    if not outcome.startswith("http_"):
        return False  # ok, an error event in the stream, a malformed stream
    after = attempt.get("retry_after_s")
    if after is not None and math.isfinite(after) and after > MAX_RETRY_AFTER_S:
        return False
    if attempt.get("x_should_retry") in ("true", "false"):
        return attempt["x_should_retry"] == "true"
    status = attempt["status"]
    return status in RETRY_STATUSES or status >= 500


def delay_s(retries_taken: int, retry_after: float | None, rng: Callable[[], float] = random.random) -> float:
    """The wait before retry number `retries_taken` (0 for the first)."""
    if retry_after is not None and math.isfinite(retry_after) and 0 < retry_after <= MAX_RETRY_AFTER_S:
        return retry_after
    return min(INITIAL_DELAY_S * 2.0 ** retries_taken, MAX_DELAY_S) * (1 - 0.25 * rng())


def read_stream(lines: Iterable[str]) -> dict[str, Any]:
    """The outcome of a 200's SSE body: ok (finished, then [DONE]), sse_error:<code>, conn:stream_cut
    (the body ended early) or bad:<what> (a stream that breaks the protocol); and the text."""
    parts: list[str] = []
    finish = None
    for line in lines:
        if not line or not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            outcome = "ok" if finish else "bad:done_without_finish"
            return {"outcome": outcome, "text": "".join(parts), "finish_reason": finish}
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            return {"outcome": "bad:json", "text": "".join(parts), "message": data[:300]}
        if "error" in event:
            err = event["error"]
            return {"outcome": f"sse_error:{err.get('code') or err.get('type')}", "text": "".join(parts),
                    "message": str(err.get("message"))[:300]}
        choice = event["choices"][0]
        parts.append(choice["delta"].get("content") or "")
        finish = choice.get("finish_reason") or finish
    return {"outcome": "conn:stream_cut", "text": "".join(parts), "finish_reason": finish}


def stream_attempt(session: requests.Session, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One POST of a streaming chat: {t, seconds, outcome, status, retry_after (the header as
    sent), retry_after_s, x_should_retry, text, ...}. Outcomes: ok, http_<status>,
    sse_error:<code>, conn:<error> (connection error, timeout or a stream cut), bad:<what>."""
    t0 = time.time()
    out: dict[str, Any] = {"t": t0, "outcome": "conn:unfinished", "status": None, "retry_after": None, "text": ""}
    try:
        with session.post(url, json=body, stream=True, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as resp:
            out["status"] = resp.status_code
            if resp.status_code == 200:
                lines = resp.iter_lines(decode_unicode=True)
                out |= read_stream(lines)
                if out["outcome"] == "ok":  # read to the end, as the SDK does, so the connection is reused
                    with contextlib.suppress(requests.RequestException):
                        for _ in lines:
                            pass
            else:
                out |= {"outcome": f"http_{resp.status_code}", "retry_after": resp.headers.get("retry-after"),
                        "retry_after_s": retry_after_s(resp.headers),
                        "x_should_retry": resp.headers.get("x-should-retry"), "message": resp.text[:300]}
    except requests.RequestException as e:  # connect/read errors and timeouts, a chunked body cut short
        out["outcome"] = f"conn:{type(e).__name__}"
    out["seconds"] = time.time() - t0
    return out


def send(session: requests.Session, url: str, item: Mapping[str, Any], ledger: Ledger, *,
         sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random,
         on_attempt: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
    """One request for the pool `item`, retried by the rule, counted in `ledger`: its record, or
    None when the ledger was closed first (then it was counted as hung, or never sent)."""
    rid = ledger.start(item["key"])
    if rid is None:
        return None
    attempt: dict[str, Any] = {"text": ""}
    for retries_taken in range(MAX_RETRIES + 1):
        attempt = stream_attempt(session, url, item["body"])
        retry = attempt["outcome"] != "ok" and retries_taken < MAX_RETRIES and should_retry(attempt)
        if retry:
            attempt["delay_s"] = delay_s(retries_taken, attempt.get("retry_after_s"), rng)
        ledger.attempt(rid, attempt)
        if on_attempt is not None:
            on_attempt(attempt)
        if not retry:
            break
        sleep(attempt["delay_s"])
    return ledger.finish(rid, attempt["text"])
