"""The chaos test's client, as a locust user: `python -m bench.chaos` runs it headless.

    locust -f bench/locust/chaos_user.py --headless --host URL --users N --spawn-rate R ...

Each user loops streaming chat completions drawn from the pool that bench/chaos.py writes
($CHAOS_POOL: greedy and seeded-sampled asks), behaving as a careful client would: a 503 or
429 is retried after its Retry-After, a connection that died is retried after a second,
each at most MAX_ATTEMPTS times. Locust keeps its own statistics (its CSV files); every logical
request is also written as one JSON line to $CHAOS_LOG (wall-clock times, every attempt's
outcome, the final text) for the report's per-fault table. Not imported by the test suite:
locust patches the standard library with gevent when it is imported.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, events, task

MAX_ATTEMPTS = 6
HUNG_S = 90.0  # a request still open this long is hung (it never is: the server's own limit is sooner)
_POOL = json.loads(open(os.environ["CHAOS_POOL"]).read()) if "CHAOS_POOL" in os.environ else []
_LOG = open(os.environ["CHAOS_LOG"], "a", buffering=1) if "CHAOS_LOG" in os.environ else None


def _attempt(client, body: dict) -> dict:
    """One HTTP attempt: its outcome ("ok", "http_<status>", "sse_error:<code>", "conn:<error>"),
    the text streamed and the Retry-After it carried."""
    t0 = time.time()
    out = {"t": t0, "outcome": "conn:unfinished", "text": "", "retry_after": None, "status": None}
    try:
        with client.post("/v1/chat/completions", json=body, stream=True, timeout=(5, HUNG_S),
                         catch_response=True, name="chat (stream)") as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["outcome"] = f"http_{resp.status_code}"
                out["retry_after"] = resp.headers.get("Retry-After")
                out["message"] = resp.text[:300]
                resp.failure(out["outcome"])
                return out
            parts, finish = [], None
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["outcome"] = "ok" if finish else "conn:done_without_finish"
                    break
                event = json.loads(data)
                if "error" in event:
                    out["outcome"] = f"sse_error:{event['error'].get('code') or event['error'].get('type')}"
                    out["message"] = str(event["error"].get("message"))[:300]
                    break
                choice = event["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            else:
                out["outcome"] = "conn:stream_cut"
            out["text"], out["finish_reason"] = "".join(parts), finish
            if out["outcome"] == "ok":
                resp.success()
            else:
                resp.failure(out["outcome"])
    except Exception as e:  # the connection died, or the read timed out
        out["outcome"] = f"conn:{type(e).__name__}"
    out["seconds"] = time.time() - t0
    return out


class ChaosUser(HttpUser):
    """A client that sends one streaming chat at a time and retries what is worth retrying."""

    def on_start(self) -> None:
        self.rng = random.Random(os.getpid() * 1000 + id(self) % 1000)

    @task
    def chat(self) -> None:
        item = self.rng.choice(_POOL)
        start = time.time()
        attempts = []
        for _ in range(MAX_ATTEMPTS):
            a = _attempt(self.client, item["body"])
            attempts.append({k: v for k, v in a.items() if k != "text"})
            if a["outcome"] == "ok" or not (a["outcome"].startswith("conn:") or a["status"] in (429, 503)):
                break
            time.sleep(float(a["retry_after"] or 1.0))
        if _LOG is not None:
            _LOG.write(json.dumps({"key": item["key"], "start": start, "end": time.time(), "attempts": attempts,
                                   "final": attempts[-1]["outcome"], "text": a["text"]}) + "\n")


@events.quitting.add_listener
def _close_log(environment, **_kw) -> None:
    if _LOG is not None:
        _LOG.close()
