"""The chaos bench's accounting and its client's retry rule (the chaos run itself takes minutes).

bench/chaos_report.py: which fault a request counts under, and its damage. bench/locust/chaos_ledger.py:
every started request counted exactly once as ok / lost / hung. bench/locust/chaos_client.py:
retries exactly by the README's rule, against a local HTTP server that answers, fails, cuts
streams and leaves requests open.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from bench.chaos import Fault, pool
from bench.chaos_report import classify, fault_rows, markdown
from bench.locust.chaos_client import MAX_RETRIES, delay_s, send, should_retry
from bench.locust.chaos_ledger import Ledger, fold


def rec(key, start, end, *outcomes, result=None, text="ref", retry_after=None):
    attempts = [{"t": start + i, "outcome": o, "status": int(o[5:]) if o.startswith("http_") else 200,
                 "retry_after": retry_after} for i, o in enumerate(outcomes)]
    result = result or ("ok" if outcomes and outcomes[-1] == "ok" else "lost")
    return {"key": key, "start": start, "end": end, "attempts": attempts, "result": result, "text": text}


def test_requests_count_under_the_last_fault_before_they_ended_and_damage_is_counted():
    run = {
        "stack": "core", "t0": 0.0, "t_end": 100.0, "reference": {"greedy-0": "ref", "seeded-0": "ref"},
        "modes": {"greedy-0": "greedy", "seeded-0": "seeded"},
        "faults": [Fault("engine core", at=40.0, pid=7, recovered_at=46.5), Fault("gateway replica", at=70.0, pid=8)],
        "records": [
            rec("greedy-0", 1, 5, "ok"),                                        # before any fault
            rec("greedy-0", 35, 50, "conn:stream_cut", "ok"),                   # open when the core died
            rec("seeded-0", 41, 48, "ok", text="different"),                    # a wrong seeded reply
            rec("greedy-0", 60, 75, "http_503", "http_503", "http_503", retry_after="1"),  # lost
            rec("greedy-0", 71, 72, "ok"),                                      # after the gateway died
            rec("greedy-0", 90, 100, "http_500", result="hung", text=""),       # open at the stop
        ],
    }
    before, core, gateway = fault_rows(run)
    assert (before["fault"], before["requests"], before["lost"], before["client_errors"]) == ("(no fault yet)", 1, 0, {})
    assert (core["requests"], core["ok"], core["lost"], core["hung"], core["retried"], core["attempts"]) == (2, 2, 0, 0, 1, 3)
    assert core["wrong_seeded"] == 1 and core["wrong_greedy"] == 0
    assert core["client_errors"] == {"conn:stream_cut": 1}
    assert core["recovery_s"] == 6.5 and core["pid"] == 7
    # the lost request was still open when the gateway died: it counts there, and so does the hung one
    assert (gateway["requests"], gateway["ok"], gateway["lost"], gateway["hung"]) == (3, 1, 1, 1)
    assert gateway["client_errors"] == {"http_503 + Retry-After": 3, "http_500": 1} and gateway["recovery_s"] is None
    # the hung request's unfinished reply is not judged
    assert gateway["wrong_greedy"] == 0
    setup = {"quick": False, "max_retries": 2, "stop_timeout_s": 120.0, "read_timeout_s": 90.0,
             "whole_within_s": 120.0, "started": {"core": 6}}
    md = markdown({"setup": setup, "rows": [before, core, gateway], "locust": {"core": {"Request Count": 9}}}, "chaos-x")
    assert "| core | gateway replica | 3 | 1 | 1 | 1 | 1 | 5 |" in md and "| core | 9 | 9 |" in md
    assert "![timeline](chaos-x-timeline.png)" in md  # the report's own plot


def test_client_error_names_and_the_pool():
    assert classify({"outcome": "http_503", "retry_after": "1"}) == "http_503 + Retry-After"
    assert classify({"outcome": "http_503", "retry_after": None}) == "http_503"
    assert classify({"outcome": "ok"}) == "ok"
    items = pool(3)
    assert [i["mode"] for i in items] == ["greedy", "seeded"] * 3
    assert len({i["key"] for i in items}) == 6
    assert all(i["body"]["stream"] for i in items) and items[1]["body"]["seed"] != items[3]["body"]["seed"]


def test_fold_counts_a_start_without_an_end_as_hung_and_refuses_double_counts():
    lines = []
    ledger = Ledger(lines.append, clock=iter(range(100)).__next__)
    a, b, c = ledger.start("k"), ledger.start("k"), ledger.start("k")
    ledger.attempt(a, {"outcome": "ok", "text": "x"})
    ledger.finish(a, "x")
    ledger.attempt(b, {"outcome": "http_400"})
    ledger.finish(b, "")
    crashed = lines + [{"event": "start", "id": "lost-in-a-crash", "key": "k", "start": 50.0}]
    records = fold(crashed, stopped_at=60.0)
    assert [(r["id"], r["result"]) for r in records] == [(a, "ok"), (b, "lost"), (c, "hung"), ("lost-in-a-crash", "hung")]
    assert records[3]["end"] == 60.0
    assert ledger.close() == 1 and ledger.start("k") is None and ledger.finish(c, "late") is None
    assert [r["result"] for r in fold(lines, stopped_at=0.0)] == ["ok", "lost", "hung"]
    with pytest.raises(ValueError, match="ended twice"):
        fold(lines + [lines[-1]], stopped_at=0.0)
    with pytest.raises(ValueError, match="never started"):
        fold([{"event": "end", "id": "x", "result": "ok"}], stopped_at=0.0)


def test_the_rule_by_status_header_and_outcome():
    def http(status, **headers):
        return {"outcome": f"http_{status}", "status": status, **headers}
    retried = [http(s) for s in (408, 409, 429, 500, 502, 503, 504)]
    retried += [{"outcome": o} for o in ("conn:ConnectionError", "conn:ReadTimeout", "conn:stream_cut")]
    retried += [http(400, x_should_retry="true"), http(503, retry_after_s=120.0)]
    assert all(should_retry(a) for a in retried)
    kept = [http(s) for s in (400, 401, 404, 413, 422)]
    kept += [http(500, x_should_retry="false"), http(429, retry_after_s=121.0)]
    kept += [{"outcome": o} for o in ("ok", "sse_error:internal", "bad:done_without_finish", "bad:json")]
    assert not any(should_retry(a) for a in kept)
    assert delay_s(0, 3.0) == 3.0 and delay_s(1, None, rng=lambda: 0.0) == 1.0
    assert delay_s(0, None, rng=lambda: 1.0) == 0.375 and delay_s(9, None, rng=lambda: 0.0) == 8.0
    assert delay_s(0, 0.0, rng=lambda: 0.0) == 0.5 and delay_s(0, 500.0, rng=lambda: 0.0) == 0.5


# ---- the client against a local server ---------------------------------------------------------
def _event(content=None, finish=None):
    delta = {"content": content} if content is not None else {}
    return "data: " + json.dumps({"choices": [{"delta": delta, "finish_reason": finish}]}) + "\n\n"


REPLY = _event("hi") + _event(finish="stop") + "data: [DONE]\n\n"

# per key: what the server does on attempt 1, 2, ... (then "ok"); "hang" waits for the test's release
SCRIPT = {
    "ok": [],
    "500-then-ok": ["500"],
    "503-retry-after-then-ok": ["503 retry-after: 1"],
    "409-then-ok": ["409"],
    "cut-then-ok": ["cut"],
    "no-done-then-ok": ["no-done"],
    "400": ["400"],
    "always-502": ["502", "502", "502", "502"],
    "500-told-not-to-retry": ["500 x-should-retry: false"],
    "429-retry-after-too-long": ["429 retry-after: 300"],
    "error-event": ["error-event"],
    "hang": ["hang"],
    "500-then-hang": ["500", "hang"],
    "stream-then-hang": ["stream-hang"],
}
EXPECTED = {  # key: (result, outcomes of the attempts the ledger holds)
    "ok": ("ok", ["ok"]),
    "500-then-ok": ("ok", ["http_500", "ok"]),
    "503-retry-after-then-ok": ("ok", ["http_503", "ok"]),
    "409-then-ok": ("ok", ["http_409", "ok"]),
    "cut-then-ok": ("ok", ["conn:ChunkedEncodingError", "ok"]),
    "no-done-then-ok": ("ok", ["conn:stream_cut", "ok"]),
    "400": ("lost", ["http_400"]),
    "always-502": ("lost", ["http_502"] * (MAX_RETRIES + 1)),
    "500-told-not-to-retry": ("lost", ["http_500"]),
    "429-retry-after-too-long": ("lost", ["http_429"]),
    "error-event": ("lost", ["sse_error:internal"]),
    "hang": ("hung", []),
    "500-then-hang": ("hung", ["http_500"]),
    "stream-then-hang": ("hung", []),
}


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock, self.release = threading.Lock(), threading.Event()
        self.seen: dict[str, int] = {}
        self.hanging = threading.Semaphore(0)

    def next_step(self, key: str) -> str:
        with self.lock:
            n = self.seen.get(key, 0)
            self.seen[key] = n + 1
        steps = SCRIPT[key]
        return steps[n] if n < len(steps) and not self.release.is_set() else "ok"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        key = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["key"]
        step = self.server.next_step(key)
        status, _, header = step.partition(" ")
        if step == "hang":
            self._hang()
            return
        if status.isdigit():
            body = json.dumps({"error": {"message": step}}).encode()
            self.send_response(int(status))
            if header:
                self.send_header(*header.split(": "))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if step == "ok":
            self._chunk(REPLY)
        elif step == "no-done":
            self._chunk(_event("hi"))
        elif step == "error-event":
            self._chunk(_event("hi") + "data: " + json.dumps({"error": {"code": "internal", "message": "x"}}) + "\n\n")
        elif step == "cut":  # a chunk promised and never finished: the connection dies mid-body
            self.wfile.write(b"100\r\n" + _event("hi").encode())
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        elif step == "stream-hang":
            self.wfile.write(b"%x\r\n%s\r\n" % (len(_event("hi")), _event("hi").encode()))
            self.wfile.flush()
            self._hang()
            return
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _hang(self) -> None:
        self.server.hanging.release()
        self.server.release.wait(10)
        self.close_connection = True  # then the client's attempt fails and its retry is answered


@pytest.fixture
def server():
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def test_every_started_request_counts_once_open_ones_as_hung_and_retries_follow_the_rule(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    lines, slept, lock = [], [], threading.Lock()
    ledger = Ledger(lambda line: lines.append(json.loads(json.dumps(line))))

    def sleep(s):
        with lock:
            slept.append(s)

    def one(key):
        with requests.Session() as session:
            send(session, url, {"key": key, "body": {"key": key, "stream": True}}, ledger, sleep=sleep,
                 rng=random.Random(key).random)

    threads = {key: threading.Thread(target=one, args=(key,), daemon=True) for key in SCRIPT}
    for t in threads.values():
        t.start()
    for key, t in threads.items():
        if EXPECTED[key][0] != "hung":
            t.join(5)
            assert not t.is_alive(), key
    for _ in range(3):  # every hanging request has reached the server
        assert server.hanging.acquire(timeout=5)
    assert ledger.close() == 3
    server.release.set()  # the open ones now end (their retry is answered) but were counted already
    for t in threads.values():
        t.join(5)
    assert ledger.open_ids == []

    records = fold(lines, stopped_at=0.0)
    assert sorted(r["key"] for r in records) == sorted(SCRIPT)  # each started request exactly once
    assert sum(line["event"] == "end" for line in lines) == len(SCRIPT)
    for r in records:
        assert (r["result"], [a["outcome"] for a in r["attempts"]]) == EXPECTED[r["key"]], r["key"]
        assert r["text"] == {"ok": "hi", "lost": r["text"], "hung": ""}[r["result"]]
    by_key = {r["key"]: r["attempts"] for r in records}
    assert by_key["503-retry-after-then-ok"][0]["delay_s"] == 1.0
    assert 0.375 <= by_key["500-then-ok"][0]["delay_s"] <= 0.5
    assert [0.375 <= by_key["always-502"][0]["delay_s"] <= 0.5, 0.75 <= by_key["always-502"][1]["delay_s"] <= 1.0,
            "delay_s" in by_key["always-502"][2]] == [True, True, False]
    assert all("delay_s" not in a for k in ("400", "500-told-not-to-retry", "429-retry-after-too-long",
                                            "error-event") for a in by_key[k])
    retries_before_close = sum(len(EXPECTED[k][1]) - 1 for k in SCRIPT if EXPECTED[k][0] != "hung") + 1
    assert len(slept) >= retries_before_close  # each retry waited (the released ones retried once more)


def test_a_refused_connection_is_retried_twice_then_lost():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines, slept = [], []
    with requests.Session() as session:
        record = send(session, f"http://127.0.0.1:{port}/v1/chat/completions", {"key": "k", "body": {}},
                      Ledger(lines.append), sleep=slept.append, rng=lambda: 0.0)
    assert record["result"] == "lost" and [a["outcome"] for a in record["attempts"]] == ["conn:ConnectionError"] * 3
    assert slept == [0.5, 1.0]
