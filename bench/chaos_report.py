"""bench/chaos.py's report: per fault window, what the clients saw; a timeline plot; the Markdown.

Used by `python -m bench.chaos`; plain functions of the run's records (bench/locust/chaos_ledger.py
`fold`), so the tests drive them with hand-made runs.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench import report  # noqa: E402


# ---- analysis --------------------------------------------------------------------------------
def classify(attempt: dict[str, Any]) -> str:
    out = attempt["outcome"]
    if out == "ok":
        return "ok"
    if out.startswith("http_") and attempt.get("retry_after"):
        return f"{out} + Retry-After"
    return out


def fault_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per window (before the first fault, then each fault until the next): what clients saw.
    Every record counts in exactly one window and as exactly one of ok / lost / hung."""
    faults = run["faults"]  # bench.chaos.Fault: name, at, pid, recovery_s, recovered_at, last_state
    edges = [float("-inf")] + [f.at for f in faults] + [float("inf")]
    names = ["(no fault yet)"] + [f.name for f in faults]
    rows = []
    for w, name in enumerate(names):
        # a request counts once: under the last fault that struck before it ended (a hung one: before the stop)
        mine = [r for r in run["records"] if edges[w] <= r["end"] < edges[w + 1]]
        errors: dict[str, int] = {}
        for r in mine:
            for att in r["attempts"]:
                kind = classify(att)
                if kind != "ok":
                    errors[kind] = errors.get(kind, 0) + 1
        wrong = {"greedy": 0, "seeded": 0}
        for r in mine:
            if r["result"] == "ok" and r["text"] != run["reference"][r["key"]]:
                wrong[run["modes"][r["key"]]] += 1
        fault = faults[w - 1] if w else None
        rows.append({
            "stack": run["stack"], "fault": name, "pid": fault.pid if fault else None,
            "requests": len(mine), **{res: sum(r["result"] == res for r in mine) for res in ("ok", "lost", "hung")},
            "retried": sum(len(r["attempts"]) > 1 for r in mine),
            "attempts": sum(len(r["attempts"]) for r in mine),
            "client_errors": errors, "wrong_greedy": wrong["greedy"], "wrong_seeded": wrong["seeded"],
            "recovery_s": fault.recovery_s if fault else None,
            "not_whole_because": (fault.last_state if fault and fault.recovered_at is None else None),
        })
    if sum(r["requests"] for r in rows) != len(run["records"]):
        raise AssertionError("a request fell outside every window")
    return rows


def timeline(runs: list[dict[str, Any]]) -> Any:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t0, horizon = run["t0"], run["t_end"] - run["t0"]
        bins = int(horizon) + 1
        done, errs, open_ = [0] * bins, [0] * bins, [0.0] * bins
        for r in run["records"]:
            s, e = r["start"] - t0, r["end"] - t0
            if 0 <= int(e) < bins and r["result"] == "ok":
                done[int(e)] += 1
            for att in r["attempts"]:
                k = int(att["t"] + att.get("seconds", 0.0) - t0)  # when the attempt failed
                if att["outcome"] != "ok" and 0 <= k < bins:
                    errs[k] += 1
            for k in range(max(int(s), 0), min(int(e), bins - 1) + 1):  # time open within each second
                open_[k] += min(e, k + 1) - max(s, k)
        xs = list(range(bins))
        ax.plot(xs, open_, label="requests in flight (mean per s)", color="tab:blue")
        ax.bar(xs, done, width=1.0, alpha=0.4, label="finished ok (per s)", color="tab:green")
        ax.bar(xs, errs, width=1.0, alpha=0.8, label="failed attempts (per s)", color="tab:red")
        for f in run["faults"]:
            x = f.at - t0
            ax.axvline(x, color="black", lw=1)
            ax.text(x, ax.get_ylim()[1] * 0.95, f" kill {f.name}", fontsize=8, va="top")
            if f.recovery_s is not None:
                ax.axvspan(x, x + f.recovery_s, color="orange", alpha=0.2)
        ax.set_title(f"stack '{run['stack']}': shaded = until whole again")
        ax.set_xlabel("seconds since the load started")
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def markdown(data: dict[str, Any], name: str) -> str:
    rows = data["rows"]
    lines = [
        "# Chaos under load",
        "",
        "`python -m bench.chaos" + (" --quick`" if data["setup"]["quick"] else "`") + ": one process killed per "
        "fault (SIGKILL, by its process title) while locust users loop streaming chats (greedy and "
        "seeded T=0.8). Every request the client started counts once, under the last fault that struck "
        "before it ended, as ok, lost or hung. Lost: the client gave up (an answer its retry rule does not "
        f"retry, or {data['setup']['max_retries']} retries spent). Hung: still open when the client stopped ("
        f"{data['setup']['stop_timeout_s']:.0f} s after the load ended; an attempt silent for "
        f"{data['setup']['read_timeout_s']:.0f} s is a timeout, retried). The client retries by the README's rule: the "
        "OpenAI SDK's (connection errors and timeouts, 408, 409, 429, >= 500; 2 retries; Retry-After "
        "up to 120 s, else 0.5 s * 2^n with jitter) plus streams cut short. Client errors: every failed "
        "attempt the client saw. Wrong: a finished reply "
        "that differs from the fault-free pass. Recovery: seconds from the kill until as many "
        "processes of the killed kind run as before, the Serve app is RUNNING with every deployment HEALTHY and no replica starting, /health answers 200 and a "
        "probe completion succeeds.",
        "",
        report.markdown_table(
            ["stack", "fault", "requests", "ok", "lost", "hung", "retried", "attempts", "client errors",
             "wrong greedy", "wrong seeded", "recovery s"],
            [[r["stack"], r["fault"], r["requests"], r["ok"], r["lost"], r["hung"], r["retried"], r["attempts"],
              ", ".join(f"{k}: {v}" for k, v in sorted(r["client_errors"].items())) or "none",
              r["wrong_greedy"], r["wrong_seeded"],
              "-" if r["fault"] == "(no fault yet)" else
              (f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else f"> {data['setup']['whole_within_s']:.0f} "
               f"({r['not_whole_because']})")] for r in rows]),
        "",
        "Requests started, each in exactly one row: " + ", ".join(f"{stack} {n}" for stack, n in
                                                                  data["setup"]["started"].items()) + ".",
        "",
        "## Locust's own statistics",
        "",
        "Locust counts attempts (a retried request is several); `attempts logged` is the sum of the "
        "table's attempts column for the stack, which should match.",
        "",
        report.markdown_table(["stack", "attempts", "attempts logged", "failures", "median ms", "p95 ms", "p99 ms",
                               "req/s"],
                              [[s, st.get("Request Count", "-"), sum(r["attempts"] for r in rows if r["stack"] == s),
                                *(st.get(k, "-") for k in ("Failure Count", "Median Response Time", "95%", "99%",
                                                           "Requests/s"))]
                               for s, st in data["locust"].items()]),
        "",
        f"![timeline]({name}-timeline.png)",
    ]
    return "\n".join(lines)
