"""Distributed under load: the served app's shard group across the nodes of a Ray cluster while
ranks die, a node goes away and the group changes width.

    python -m bench.multinode [--quick]

A local cluster (bench/cluster.py: a head and three worker nodes, raylets of their own on this
machine). The shipped app config with the demo model, speculation off, the gateway and the engine
replica (rank 0) on the head node, a shard group of 2 ranks spread one per node (STRICT_SPREAD,
min_shards 2, max_shards 3). Eight clients loop streaming chats from a pool of greedy and seeded
(T=0.8) asks; a fault-free pass gave the reference replies. Faults, in turn, one every `--gap-s`:

- redundancy 1 (every expert on two ranks): SIGKILL rank 1's process; remove rank 1's node
  (`Cluster.remove_node`, not graceful); widen the group 2 -> 3 and narrow it back (`resize`);
- redundancy 0 (the app deployed again): SIGKILL rank 1's process.

Per fault (the requests that ended after it and before the next): ok / lost / wrong, the longest
gap between two chunks of any stream (and, apart, the longest wait for a first chunk), seconds
until whole again (the group back to its width, /health 200), tokens/s while it was not. Writes
bench/reports/multinode.{json,md} and multinode-timeline.png (`--quick`: multinode-quick*).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import report
from bench.chaos import pool, reference
from bench.cluster import local_cluster
from bench.load_test import SERVE_CONFIG
from bench.serve_app import serve_on_ray

NODES = {"node_head": 4, "node_w1": 2, "node_w2": 2, "node_w3": 2}
PIN = 0.01  # of the head node's own resource: pins the engine replica there
STREAMS = 8
ATTEMPTS = 3  # a failed stream is sent again up to twice; then it is lost
WHOLE_WITHIN_S = 120.0
GAP_GOAL_S = 1.0  # redundancy 1, rank killed


def app_config(redundancy: int, grpc_port: int):
    from moeserve.config import AppConfig

    return AppConfig.load(SERVE_CONFIG, {
        "speculative": {"draft": "none"},
        "engine": {"expert_load_report_s": 0},
        # widths change by hand only (else the load rules narrow a hand-widened group after 10 s)
        "shards": {"num_shards": 2, "min_shards": 2, "max_shards": 3, "redundancy": redundancy,
                   "strategy": "STRICT_SPREAD", "resize_after_s": 3600},
        "gateway": {"grpc_port": grpc_port, "grpc_host": "127.0.0.1"},
        "deployments": {"engine": {"resources": {"node_head": PIN}}},
    })


@dataclass
class Fault:
    name: str
    act: Any  # () -> None: strikes
    width: int  # whole again: the group this wide, re-formed `reforms` times since the fault
    reforms: int
    at: float = 0.0
    generation: int = 0
    whole_at: float | None = None

    @property
    def whole_s(self) -> float | None:
        return None if self.whole_at is None else self.whole_at - self.at


@dataclass
class Stream:
    key: str
    start: float
    chunks: list[float] = field(default_factory=list)  # arrival times, every attempt
    text: str = ""
    attempts: int = 0
    end: float = 0.0
    ok: bool = False


class Load:
    """STREAMS clients, each looping over the pool until `stop`; every request is a Stream."""

    def __init__(self, url: str, items: list[dict[str, Any]]) -> None:
        self.url, self.items, self.streams = url, items, []
        self.stop = threading.Event()

    async def _attempt(self, client: httpx.AsyncClient, body: dict[str, Any], s: Stream) -> None:
        parts = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    s.text = "".join(parts)
                    return
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    s.chunks.append(time.time())
                    parts.append(event["choices"][0]["delta"].get("content") or "")
        raise RuntimeError("stream ended without [DONE]")

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        n = i
        while not self.stop.is_set():
            item = self.items[n % len(self.items)]
            n += STREAMS
            s = Stream(item["key"], time.time())
            self.streams.append(s)
            while s.attempts < ATTEMPTS and not s.ok:
                s.attempts += 1
                try:
                    await self._attempt(client, item["body"], s)
                    s.ok = True
                except (httpx.HTTPError, RuntimeError) as e:
                    print(f"  {s.key}: attempt {s.attempts} failed: {type(e).__name__}: {e}", flush=True)
                    await asyncio.sleep(0.5)
            s.end = time.time()

    def run(self) -> None:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
                await asyncio.gather(*(self._client(client, i) for i in range(STREAMS)))
        asyncio.run(main())


class Sampler:
    """The engine's generated-token counter and group width, twice a second."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.samples = engine, []
        self.stop = threading.Event()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats.remote().result(timeout_s=30)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                s = self.stats()
                self.samples.append((time.time(), s["generated_tokens"], s["shard_group"]["width"]))
            except Exception as e:  # the replica is busy re-forming: the next sample tells
                print(f"  stats: {type(e).__name__}", flush=True)

    def tokens_per_s(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def rank1(url: str) -> dict[str, Any]:
    shards = httpx.get(f"{url}/health", timeout=30).json()["engine"]["shards"]
    return next(s for s in shards if s.get("rank") == 1)


def run_phase(name: str, redundancy: int, nodes: Any, items: list[dict[str, Any]], gap_s: float,
              ref: dict[str, str] | None) -> dict[str, Any]:
    from ray import serve

    from deployments.app import APP_NAME, build

    def app(grpc_port: int) -> tuple:
        return build(app_config(redundancy, grpc_port)), APP_NAME, "/"

    print(f"[{name}] deploying", flush=True)
    with serve_on_ray(app, proxy_location="HeadOnly", healthy_s=300) as urls:
        url = urls["http"]
        engine = serve.get_deployment_handle("engine", APP_NAME)
        ref = ref or reference(url, items)
        sampler = Sampler(engine)

        def kill_rank() -> None:
            os.kill(rank1(url)["pid"], signal.SIGKILL)  # the node shares this machine: a local pid

        def remove_node() -> None:
            node_id = rank1(url)["node_id"]
            nodes.remove(next(n for n, i in nodes.items() if i == node_id))

        def resize(width: int):
            return lambda: engine.resize.remote(width).result(timeout_s=30)

        if redundancy:
            # a dead rank: the survivor re-forms alone, then a replacement joins (min_shards 2)
            faults = [Fault("rank killed (redundancy 1)", kill_rank, 2, 2),
                      Fault("worker node removed", remove_node, 2, 2),
                      Fault("resize 2 -> 3", resize(3), 3, 1),
                      Fault("resize 3 -> 2", resize(2), 2, 1)]
        else:
            faults = [Fault("rank killed (redundancy 0)", kill_rank, 2, 2)]
        load = Load(url, items)
        threads = [threading.Thread(target=load.run), threading.Thread(target=sampler.run)]
        for t in threads:
            t.start()
        t0 = time.time()
        try:
            for i, f in enumerate(faults):
                time.sleep(max(0.0, t0 + gap_s * (i + 1) - time.time()))
                f.generation, f.at = sampler.stats()["shard_group"]["generation"], time.time()
                f.act()
                print(f"  t={f.at - t0:5.1f}s {f.name}", flush=True)
                while time.time() - f.at < WHOLE_WITHIN_S:
                    time.sleep(0.5)
                    try:
                        group = sampler.stats()["shard_group"]
                        if (group["width"] == f.width and group["generation"] >= f.generation + f.reforms
                                and httpx.get(f"{url}/health", timeout=10).status_code == 200):
                            f.whole_at = time.time()
                            print(f"  whole again after {f.whole_s:.1f}s", flush=True)
                            break
                    except Exception:  # not answering yet
                        pass
            time.sleep(max(0.0, faults[-1].at + gap_s - time.time()))
        finally:
            load.stop.set()
            threads[0].join()
            sampler.stop.set()
            threads[1].join()
        t_end = time.time()
        final = sampler.stats()["shard_group"]
    return {"phase": name, "t0": t0, "t_end": t_end, "faults": faults, "streams": load.streams, "reference": ref,
            "modes": {i["key"]: i["mode"] for i in items}, "sampler": sampler.samples, "group": final,
            "tokens_per_s": sampler.tokens_per_s}


def gaps(s: Stream) -> list[tuple[float, float]]:
    """(end time, length) of each gap between two chunks of the stream."""
    return [(b, b - a) for a, b in zip(s.chunks, s.chunks[1:])]


def rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    faults = run["faults"]
    edges = [run["t0"]] + [f.at for f in faults] + [run["t_end"] + 1e9]
    names = ["(no fault yet)"] + [f.name for f in faults]
    out = []
    for w, name in enumerate(names):
        lo, hi = edges[w], edges[w + 1]
        mine = [s for s in run["streams"] if lo <= s.end < hi]
        window_gaps = [g for s in run["streams"] for t, g in gaps(s) if lo <= t < hi]
        first = [s.chunks[0] - s.start for s in run["streams"] if s.chunks and lo <= s.chunks[0] < hi]
        fault = faults[w - 1] if w else None
        wrong = {"greedy": 0, "seeded": 0}
        for s in mine:
            if s.ok and s.text != run["reference"][s.key]:
                wrong[run["modes"][s.key]] += 1
        whole_at = fault.whole_at if fault and fault.whole_at else None
        out.append({
            "phase": run["phase"], "fault": name, "requests": len(mine), "ok": sum(s.ok for s in mine),
            "lost": sum(not s.ok for s in mine), "retried": sum(s.attempts > 1 for s in mine),
            "wrong_greedy": wrong["greedy"], "wrong_seeded": wrong["seeded"],
            "longest_gap_s": max(window_gaps, default=None), "longest_first_chunk_s": max(first, default=None),
            "whole_s": fault.whole_s if fault else None,
            "tokens_per_s": run["tokens_per_s"](lo, min(hi, run["t_end"])) if not fault else
            (run["tokens_per_s"](fault.at, whole_at) if whole_at else None),
        })
    return out


def timeline(runs: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(11, 4.6 * len(runs)), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [4, 1] * len(runs)})
    for ax, wax, run in zip(axes[::2, 0], axes[1::2, 0], runs):
        t0 = run["t0"]
        xs, ys = zip(*[(t - t0, g) for s in run["streams"] for t, g in gaps(s)]) if run["streams"] else ((), ())
        ax.scatter(xs, ys, s=4, alpha=0.5, label="gap between two chunks of a stream (s)")
        ax.axhline(GAP_GOAL_S, color="red", lw=0.8, ls="--", label=f"{GAP_GOAL_S:.0f} s")
        ax.set_ylabel("gap (s)")
        for f in run["faults"]:
            ax.axvline(f.at - t0, color="black", lw=1)
            ax.text(f.at - t0, ax.get_ylim()[1] * 0.97, f" {f.name}", fontsize=8, va="top")
            if f.whole_s is not None:
                ax.axvspan(f.at - t0, f.at - t0 + f.whole_s, color="orange", alpha=0.2)
        twin = ax.twinx()
        samples = run["sampler"]
        rates = [(b[0] - t0, (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(samples, samples[1:]) if b[0] > a[0]]
        if rates:
            twin.plot(*zip(*rates), color="tab:green", lw=1, label="tokens/s (engine)")
            wax.step([s[0] - t0 for s in samples], [s[2] for s in samples], color="tab:purple", where="post")
        wax.set_ylabel("ranks")
        wax.set_ylim(0, 4)
        wax.set_xlabel("seconds since the load started")
        twin.legend(loc="upper right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"{run['phase']}: shaded = until whole again")
    fig.tight_layout()
    return fig


def markdown(data: dict[str, Any]) -> str:
    def num(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    table = report.markdown_table(
        ["phase", "fault", "requests", "ok", "lost", "retried", "wrong greedy", "wrong seeded", "longest gap s",
         "longest first chunk s", "whole again s", "tokens/s"],
        [[r["phase"], r["fault"], r["requests"], r["ok"], r["lost"], r["retried"], r["wrong_greedy"],
          r["wrong_seeded"], num(r["longest_gap_s"]), num(r["longest_first_chunk_s"]), num(r["whole_s"], "{:.1f}"),
          num(r["tokens_per_s"], "{:.0f}")] for r in data["rows"]])
    setup = data["setup"]
    return "\n".join([
        "# Multi-node: rank and node failures, elastic width, under load",
        "",
        f"`python -m bench.multinode{' --quick' if setup['quick'] else ''}`: a Ray cluster of "
        f"{len(NODES)} nodes on one machine ({', '.join(f'{n} {c} CPUs' for n, c in NODES.items())}); the "
        "demo model served with a shard group of 2 ranks, one per node (STRICT_SPREAD, min_shards 2, "
        "max_shards 3; widths set by hand: `shards.resize_after_s` 3600 holds the load rules off), the gateway and the engine replica (rank 0) on the head. {STREAMS} clients loop "
        f"streaming chats ({setup['pool']} asks, greedy and seeded T=0.8, {setup['max_tokens']} tokens) while "
        f"a fault strikes every {setup['gap_s']:.0f} s.",
        "",
        "A request counts once, under the last fault before it ended. Lost: failed "
        f"{ATTEMPTS} times. Wrong: a finished reply that differs from the fault-free pass. Longest gap: "
        "between two chunks of any stream, ending in the row's window (chunks carry the tokens of "
        "25-200 ms: `engine.stream_interval_s`). Longest first chunk: the longest wait for a stream's "
        "first chunk in the window (a request that arrives during a pause waits in the queue). Whole "
        "again: seconds until the group has its width again (after a dead rank: a replacement rank "
        "loaded and joined) and /health answers 200. Tokens/s: the engine's, over the row's window "
        "before the first fault, else from the fault until whole again.",
        "",
        table,
        "",
        f"Goal (redundancy 1, rank killed): longest gap <= {GAP_GOAL_S:.1f} s, 0 lost, 0 wrong. "
        "Node removed: whole again within 30 s.",
        "",
        "![timeline](multinode-timeline.png)",
    ])


def main(argv: list[str] | None = None) -> int:
    from bench.chaos import MAX_TOKENS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter gaps, redundancy 1 only")
    ap.add_argument("--gap-s", type=float, default=None, help="seconds between faults (and before the first)")
    args = ap.parse_args(argv)
    gap = args.gap_s or (20.0 if args.quick else 30.0)
    items = pool(4 if args.quick else 8)
    runs = []
    with local_cluster(NODES, wait_s=180) as nodes:
        runs.append(run_phase("redundancy 1", 1, nodes, items, gap, None))
        if not args.quick:
            runs.append(run_phase("redundancy 0", 0, nodes, items, gap, runs[0]["reference"]))
    data = {
        "environment": report.environment(threads=1),
        "setup": {"quick": args.quick, "nodes": NODES, "streams": STREAMS, "gap_s": gap, "pool": len(items),
                  "max_tokens": MAX_TOKENS, "attempts": ATTEMPTS, "whole_within_s": WHOLE_WITHIN_S},
        "rows": [r for run in runs for r in rows(run)],
        "groups_at_end": {run["phase"]: run["group"] for run in runs},
    }
    md = markdown(data)
    print(md)
    for p in report.write("multinode-quick" if args.quick else "multinode", data, md, {"timeline": timeline(runs)}):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
