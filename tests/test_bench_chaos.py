"""bench/chaos.py's accounting: which fault a request counts under, lost / hung / wrong replies,
and how client errors are named (the chaos run itself takes minutes; it is a bench script)."""

from __future__ import annotations

from bench.chaos import Fault, classify, fault_rows, pool


def rec(key, start, end, *outcomes, text="ref", retry_after=None):
    attempts = [{"t": start + i, "outcome": o, "status": int(o[5:]) if o.startswith("http_") else 200,
                 "retry_after": retry_after} for i, o in enumerate(outcomes)]
    return {"key": key, "start": start, "end": end, "attempts": attempts, "final": outcomes[-1], "text": text}


def test_requests_count_under_the_last_fault_before_they_ended_and_damage_is_counted():
    run = {
        "stack": "core", "t0": 0.0, "t_end": 100.0, "reference": {"greedy-0": "ref", "seeded-0": "ref"},
        "modes": {"greedy-0": "greedy", "seeded-0": "seeded"},
        "faults": [Fault("engine core", at=40.0, pid=7, recovered_at=46.5), Fault("gateway replica", at=70.0, pid=8)],
        "records": [
            rec("greedy-0", 1, 5, "ok"),                                      # before any fault
            rec("greedy-0", 35, 50, "conn:stream_cut", "ok"),                 # open when the core died
            rec("seeded-0", 41, 48, "ok", text="different"),                  # a wrong seeded reply
            rec("greedy-0", 60, 200, "http_503", "http_503", retry_after="1"),  # lost and hung
            rec("greedy-0", 71, 72, "ok"),                                    # after the gateway died
        ],
    }
    before, core, gateway = fault_rows(run, hung_s=90)
    assert (before["fault"], before["requests"], before["lost"], before["client_errors"]) == ("(no fault yet)", 1, 0, {})
    assert (core["requests"], core["ok"], core["lost"], core["retried"]) == (2, 2, 0, 1)
    assert core["wrong_seeded"] == 1 and core["wrong_greedy"] == 0
    assert core["client_errors"] == {"conn:stream_cut": 1}
    assert core["recovery_s"] == 6.5 and core["pid"] == 7
    # the lost request was still open when the gateway died: it counts there
    assert (gateway["requests"], gateway["lost"], gateway["hung"]) == (2, 1, 1)
    assert gateway["client_errors"] == {"http_503 + Retry-After": 2} and gateway["recovery_s"] is None


def test_client_error_names_and_the_pool():
    assert classify({"outcome": "http_503", "retry_after": "1"}) == "http_503 + Retry-After"
    assert classify({"outcome": "http_503", "retry_after": None}) == "http_503"
    assert classify({"outcome": "ok"}) == "ok"
    items = pool(3)
    assert [i["mode"] for i in items] == ["greedy", "seeded"] * 3
    assert len({i["key"] for i in items}) == 6
    assert all(i["body"]["stream"] for i in items) and items[1]["body"]["seed"] != items[3]["body"]["seed"]
