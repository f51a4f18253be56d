"""Chaos under load: kill the served stack's processes as an operator would, and count the damage.

    python -m bench.chaos [--quick]

For each of two stacks, on a local Ray with the shipped app config (gRPC off, two gateway
replicas so that one can die while the other serves):

- `core`: the engine core in its own process (the served default). Faults: the engine core
  process, the engine replica, a gateway replica.
- `sharded`: an expert-parallel group of 2 shards and the draft model as its own deployment
  (the engine core then runs on a thread of the replica). Faults: a shard actor, the draft
  worker.
- `direct` (`--stacks direct`): the core stack with `gateway.direct_tokens` on, so tokens come
  on the engine replica's own socket; the core stack's faults.

1. a fault-free pass: every ask of the pool (greedy and seeded-sampled chats) once, 4 at a time:
   the reference replies;
2. locust, headless (bench/locust/chaos_user.py), ramps up virtual users that loop streaming
   chats from the same pool, retrying by the README's rule (bench/locust/chaos_client.py: the
   OpenAI SDK's, plus streams cut short) and writing every request down when it starts and
   when it ends (bench/locust/chaos_ledger.py);
3. at fixed times the driver SIGKILLs one process per fault (found by its process title,
   `ray::ShardActor` and the like) and measures the seconds until the service is whole again:
   as many processes of that kind as before (none of them the killed one), the Serve app
   RUNNING with every deployment HEALTHY and no replica starting, GET /health 200, and a probe
   completion answered;
4. per fault (the requests that ended after it and before the next): every request the
   client started, counted once as ok, lost (the client gave up) or hung (still open when the
   client stopped), the client-visible errors by kind, replies that differ from the reference
   (greedy and seeded separately), recovery seconds; locust's own statistics (which count
   attempts, checked against the log's); a timeline plot.

Writes bench/reports/chaos.{json,md} and chaos-timeline.png (`--quick`: chaos-quick*).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import report
from bench.chaos_report import fault_rows, markdown, timeline
from bench.load_test import JSON_ASKS, SERVE_CONFIG, free_port, start_server, stop_server
from bench.locust.chaos_client import MAX_RETRIES, READ_TIMEOUT_S
from bench.locust.chaos_ledger import fold
from demo.prompts import FREE_FORM

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "bench" / "locust" / "chaos_user.py"
MAX_TOKENS = 40
WHOLE_WITHIN_S = 120.0  # give up measuring recovery after this
STOP_TIMEOUT_S = 120.0  # after the load ends, how long requests in flight may finish before they count as hung

# What an operator kills, by process title (Ray names its workers "ray::<actor class>", Serve
# replicas "ray::ServeReplica:<app>:<deployment>"); the engine core is `python -m ...core_client`,
# a draft replica's worker `python -m deployments.draft_worker`.
TARGETS = {
    "engine core": "moeserve.engine.core_client",
    "engine replica": "ray::ServeReplica:moeserve:engine",
    "gateway replica": "ray::ServeReplica:moeserve:gateway",
    "shard actor": "ray::ShardActor",
    "draft worker": "deployments.draft_worker",
}
TWO_GATEWAYS = {"gateway": {"autoscaling": {"min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 64}}}
STACKS: dict[str, dict[str, Any]] = {
    "core": {"overrides": {"deployments": TWO_GATEWAYS},
             "faults": ["engine core", "engine replica", "gateway replica"]},
    "sharded": {"overrides": {"deployments": TWO_GATEWAYS, "shards": {"num_shards": 2},
                              "speculative": {"draft": "model", "placement": "deployment"}},
                "faults": ["shard actor", "draft worker"]},
    "direct": {"overrides": {"deployments": TWO_GATEWAYS, "gateway": {"direct_tokens": True}},
               "faults": ["engine core", "engine replica", "gateway replica"]},
}


def app_config(overrides: dict[str, Any]):
    """The shipped app config with gRPC off (port 9000 may be taken on this box) and `overrides`."""
    from moeserve.config import AppConfig, deep_merge

    return AppConfig.load(SERVE_CONFIG, deep_merge({"gateway": {"grpc_port": 0}}, overrides))


# ---- the pool of asks ----------------------------------------------------------------------
def pool(n_prompts: int) -> list[dict[str, Any]]:
    """Greedy and seeded-sampled streaming chats; `key` names each for the reference."""
    asks = (list(JSON_ASKS) + list(FREE_FORM))[:n_prompts]
    out = []
    for i, ask in enumerate(asks):
        base = {"model": "demo-moe", "messages": [{"role": "user", "content": ask}], "stream": True,
                "max_tokens": MAX_TOKENS}
        out.append({"key": f"greedy-{i}", "mode": "greedy", "body": base | {"temperature": 0.0}})
        out.append({"key": f"seeded-{i}", "mode": "seeded", "body": base | {"temperature": 0.8, "seed": 1000 + i}})
    return out


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    parts = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event in the reference pass: {event['error']}")
                parts.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(parts)


def reference(url: str, items: list[dict[str, Any]]) -> dict[str, str]:
    """The fault-free replies, 4 requests at a time."""
    async def main() -> dict[str, str]:
        sem = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def go(item):
                async with sem:
                    return item["key"], await _one(client, item["body"])
            return dict(await asyncio.gather(*(go(i) for i in items)))
    return asyncio.run(main())


# ---- faults and recovery ---------------------------------------------------------------------
def find(title: str) -> list[int]:
    """PIDs of live processes under this one (the local Ray it started: raylet, workers and what
    they spawn) whose command line mentions `title`; another Ray on the same box is left alone."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if title in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
    return sorted(out)


def kill(fault: str) -> tuple[int, int]:
    """SIGKILL one process of the kind; returns its pid and how many of the kind were running."""
    pids = find(TARGETS[fault])
    if not pids:
        raise RuntimeError(f"no process for {fault!r} ({TARGETS[fault]}) is running")
    os.kill(pids[0], signal.SIGKILL)
    return pids[0], len(pids)


def whole(url: str, probe: dict[str, Any], fault: Fault) -> tuple[bool, str]:
    """Is the service whole: the killed kind of process back to its count, the app RUNNING,
    every deployment HEALTHY with no replica starting or stopping, /health 200, and a probe
    request answered?"""
    from ray import serve

    from deployments.app import APP_NAME

    back = [p for p in find(TARGETS[fault.name]) if p != fault.pid]
    if len(back) < fault.count:
        return False, f"{len(back)} of {fault.count} {fault.name} processes"
    app = serve.status().applications.get(APP_NAME)
    if app is None or getattr(app.status, "value", str(app.status)) != "RUNNING":
        return False, "app not running"
    for name, dep in app.deployments.items():
        states = {getattr(k, "value", str(k)): v for k, v in dep.replica_states.items() if v}
        if getattr(dep.status, "value", str(dep.status)) != "HEALTHY" or set(states) != {"RUNNING"}:
            return False, f"{name}: {getattr(dep.status, 'value', dep.status)} {states}"
    try:
        if httpx.get(f"{url}/health", timeout=10).status_code != 200:
            return False, "/health not 200"
        body = probe["body"] | {"stream": False, "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        return (r.status_code == 200), f"probe {r.status_code}"
    except httpx.HTTPError as e:
        return False, f"{type(e).__name__}"


@dataclass
class Fault:
    name: str
    at: float  # wall clock
    pid: int = 0
    count: int = 0  # processes of its kind running when it was killed
    recovered_at: float | None = None
    last_state: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


def inject(faults: list[Fault], url: str, probe: dict[str, Any], t0: float) -> None:
    """Kill each fault's process at its time; then poll until the service is whole."""
    for f in faults:
        time.sleep(max(0.0, f.at - time.time()))
        f.at = time.time()
        f.pid, f.count = kill(f.name)
        print(f"  t={f.at - t0:5.1f}s killed {f.name} (pid {f.pid})", flush=True)
        time.sleep(1.0)
        while time.time() - f.at < WHOLE_WITHIN_S:
            ok, f.last_state = whole(url, probe, f)
            if ok:
                f.recovered_at = time.time()
                print(f"  whole again after {f.recovery_s:.1f}s", flush=True)
                break
            time.sleep(0.5)


# ---- one stack -------------------------------------------------------------------------------
def run_stack(name: str, users: int, spawn_rate: float, gap_s: float, items: list[dict[str, Any]],
              workdir: Path) -> dict[str, Any]:
    spec = STACKS[name]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[{name}] starting the stack", flush=True)
    start_s = start_server(app_config(spec["overrides"]), num_cpus=6, port=port)
    try:
        ref = reference(url, items)
        print(f"[{name}] reference: {len(ref)} replies; load + faults", flush=True)
        pool_file, log_file = workdir / f"{name}-pool.json", workdir / f"{name}-requests.jsonl"
        pool_file.write_text(json.dumps(items))
        run_time = gap_s * (len(spec["faults"]) + 1)
        stats_file = workdir / f"{name}-locust.json"
        env = dict(os.environ, CHAOS_POOL=str(pool_file), CHAOS_LOG=str(log_file), CHAOS_STATS=str(stats_file),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
               "--users", str(users), "--spawn-rate", str(spawn_rate), "--run-time", f"{int(run_time)}s",
               "--stop-timeout", str(int(STOP_TIMEOUT_S)), "--only-summary", "--loglevel", "WARNING"]
        t0 = time.time()
        locust = subprocess.Popen(cmd, env=env, cwd=ROOT)
        faults = [Fault(f, t0 + gap_s * (i + 1)) for i, f in enumerate(spec["faults"])]
        injector = threading.Thread(target=inject, args=(faults, url, items[0], t0))
        injector.start()
        locust.wait()
        injector.join()
        t_end = time.time()
        lines = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
        records = fold(lines, stopped_at=t_end)
    finally:
        stop_server()
    return {"stack": name, "start_s": start_s, "t0": t0, "t_end": t_end, "faults": faults, "records": records,
            "reference": ref, "modes": {i["key"]: i["mode"] for i in items},
            "locust": json.loads(stats_file.read_text()) if stats_file.is_file() else {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer users, shorter gaps (a smoke run)")
    ap.add_argument("--stacks", nargs="+", default=["core", "sharded"], choices=list(STACKS),
                    help="direct: the core stack with tokens on the engine replica's socket (gateway.direct_tokens)")
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--gap-s", type=float, default=None, help="seconds between faults (and before the first)")
    ap.add_argument("--name", default=None, help="report name (default: chaos, or chaos-quick)")
    args = ap.parse_args(argv)
    users = args.users or (3 if args.quick else 6)
    gap = args.gap_s or (30.0 if args.quick else 45.0)
    items = pool(4 if args.quick else 8)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.stacks:
            runs.append(run_stack(name, users, spawn_rate=users / min(20.0, gap * 0.6), gap_s=gap, items=items,
                                  workdir=Path(tmp)))
    rows = [row for run in runs for row in fault_rows(run)]
    data = {
        "environment": report.environment(threads=1),
        "setup": {"quick": args.quick, "users": users, "gap_s": gap, "pool": len(items), "max_tokens": MAX_TOKENS,
                  "stop_timeout_s": STOP_TIMEOUT_S, "whole_within_s": WHOLE_WITHIN_S, "read_timeout_s": READ_TIMEOUT_S, "max_retries": MAX_RETRIES,
                  "started": {run["stack"]: len(run["records"]) for run in runs}, "stacks": {n: STACKS[n] for n in args.stacks}},
        "rows": rows,
        "locust": {run["stack"]: run["locust"] for run in runs},
        "stack_start_s": {run["stack"]: run["start_s"] for run in runs},
    }
    name = args.name or ("chaos-quick" if args.quick else "chaos")
    md = markdown(data, name)
    print(md)
    for p in report.write(name, data, md, {"timeline": timeline(runs)}):
        print("wrote", p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
