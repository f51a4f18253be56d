"""The chaos test's client, as a locust user: `python -m bench.chaos` runs it headless.

    locust -f bench/locust/chaos_user.py --headless --host URL --users N --spawn-rate R ...

Each user loops streaming chat completions drawn from the pool that bench/chaos.py writes
($CHAOS_POOL: greedy and seeded-sampled asks), retrying exactly by the rule in
bench/locust/chaos_client.py (the README's). Every request is written to $CHAOS_LOG when it
starts and once more when it ends (bench/locust/chaos_ledger.py); when locust stops, every
request still open is written as hung. Locust's own statistics ($CHAOS_STATS at the end) count
attempts.
Not imported by the test suite: locust patches the standard library with gevent when it is
imported.
"""

from __future__ import annotations

import json
import os
import random

import requests
from locust import User, events, task

from bench.locust.chaos_client import send
from bench.locust.chaos_ledger import Ledger

_POOL = json.loads(open(os.environ["CHAOS_POOL"]).read()) if "CHAOS_POOL" in os.environ else []
_LOG = open(os.environ["CHAOS_LOG"], "a", buffering=1) if "CHAOS_LOG" in os.environ else None
LEDGER = Ledger(lambda line: _LOG.write(json.dumps(line) + "\n") if _LOG is not None else None)


class ChaosUser(User):
    """A client that sends one streaming chat at a time and retries by the README's rule."""

    def on_start(self) -> None:
        self.rng = random.Random(os.getpid() * 1000 + id(self) % 1000)
        self.session = requests.Session()

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        send(self.session, f"{self.host}/v1/chat/completions", self.rng.choice(_POOL), LEDGER,
             rng=self.rng.random, on_attempt=self._report)

    def _report(self, attempt: dict) -> None:
        """Each attempt into locust's statistics."""
        ok = attempt["outcome"] == "ok"
        self.environment.events.request.fire(
            request_type="POST", name="chat (stream)", response_time=attempt["seconds"] * 1000.0,
            response_length=len(attempt["text"]), exception=None if ok else RuntimeError(attempt["outcome"]),
            context={}, response=None, url=f"{self.host}/v1/chat/completions", start_time=attempt["t"])


@events.test_stop.add_listener
def _count_the_open_as_hung(environment, **_kw) -> None:
    LEDGER.close()  # users are stopped (or killed after --stop-timeout) by now


@events.quitting.add_listener
def _close_log(environment, **_kw) -> None:
    LEDGER.close()
    if _LOG is not None:
        _LOG.close()
    if "CHAOS_STATS" in os.environ:  # locust's final totals (its CSV is written before the last users stop)
        total = environment.stats.total
        with open(os.environ["CHAOS_STATS"], "w") as f:
            json.dump({"Request Count": total.num_requests, "Failure Count": total.num_failures,
                       "Median Response Time": total.median_response_time,
                       "95%": total.get_response_time_percentile(0.95),
                       "99%": total.get_response_time_percentile(0.99), "Requests/s": total.total_rps}, f)
