"""The chaos client's accounting: every request it starts is counted exactly once, as ok, lost or hung.

A request is written down when it starts (one "start" line: id, key, wall-clock start), so
none can escape the count; it ends with one "end" line whose `result` is

- ok: its last attempt streamed a complete reply;
- lost: the client gave up (the retry rule said stop, or its retries ran out);
- hung: it was still open when the client stopped (`Ledger.close`, on locust's test_stop).

A request that finishes after `close` has already been counted as hung and is not written
again. `fold` turns the lines back into one record per started request, and treats a start
without an end (the client process died before it could close) as hung too. Plain Python:
the locust user and the unit tests share it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

RESULTS = ("ok", "lost", "hung")


class Ledger:
    """Open requests by id, with the attempts each has made so far; `write` gets every line."""

    def __init__(self, write: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.time) -> None:
        self._write, self._clock = write, clock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: dict[str, dict[str, Any]] = {}
        self.closed_at: float | None = None

    def start(self, key: str) -> str | None:
        """A new request for the pool item `key`: its id, or None once the client has stopped
        (the caller then sends nothing, so there is nothing to count)."""
        with self._lock:
            if self.closed_at is not None:
                return None
            rid = f"{os.getpid()}-{next(self._ids)}"
            self._open[rid] = {"id": rid, "key": key, "start": self._clock(), "attempts": []}
            self._write({"event": "start", "id": rid, "key": key, "start": self._open[rid]["start"]})
            return rid

    def attempt(self, rid: str, attempt: dict[str, Any]) -> None:
        """One finished attempt (without its text: only the final reply's text is kept)."""
        with self._lock:
            if rid in self._open:
                self._open[rid]["attempts"].append({k: v for k, v in attempt.items() if k != "text"})

    def finish(self, rid: str, text: str) -> dict[str, Any] | None:
        """The request is over: ok if its last attempt was, else lost. None if it was no longer
        open (already counted as hung by `close`)."""
        with self._lock:
            rec = self._open.pop(rid, None)
            if rec is None:
                return None
            last = rec["attempts"][-1]["outcome"] if rec["attempts"] else "none"
            rec |= {"end": self._clock(), "result": "ok" if last == "ok" else "lost", "text": text}
            self._write({"event": "end", **rec})
            return rec

    def close(self) -> int:
        """The client stopped: every request still open is hung. Returns how many were."""
        with self._lock:
            if self.closed_at is None:
                self.closed_at = self._clock()
            hung = list(self._open.values())
            self._open.clear()
            for rec in hung:
                rec |= {"end": self.closed_at, "result": "hung", "text": ""}
                self._write({"event": "end", **rec})
            return len(hung)

    @property
    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._open)


def fold(lines: Iterable[dict[str, Any]], stopped_at: float) -> list[dict[str, Any]]:
    """One record per started request, in start order: {id, key, start, end, result, attempts,
    text}. A start without an end is hung, ending at `stopped_at`. Raises ValueError on an end
    without a start or a second end: either would make a request count other than once."""
    started: dict[str, dict[str, Any]] = {}
    ended: dict[str, dict[str, Any]] = {}
    for line in lines:
        rid = line["id"]
        if line["event"] == "start":
            if rid in started:
                raise ValueError(f"request {rid} started twice")
            started[rid] = line
        elif line["event"] == "end":
            if rid in ended:
                raise ValueError(f"request {rid} ended twice")
            if line["result"] not in RESULTS:
                raise ValueError(f"request {rid} ended as {line['result']!r}")
            ended[rid] = line
        else:
            raise ValueError(f"unknown event {line['event']!r}")
    if missing := set(ended) - set(started):
        raise ValueError(f"{len(missing)} requests ended that never started, e.g. {sorted(missing)[0]}")
    out = []
    for rid, s in started.items():
        e = ended.get(rid) or {"end": stopped_at, "result": "hung", "attempts": [], "text": ""}
        out.append({"id": rid, "key": s["key"], "start": s["start"], "end": e["end"], "result": e["result"],
                    "attempts": e["attempts"], "text": e["text"]})
    return out
