"""`moeserve serve` end to end, as a user runs it: it starts a local Ray, deploys the demo app,
prints its URLs, answers, and stops cleanly when Ctrl-C reaches its process group."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from model_shards.local_group import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_moeserve_serve_answers_and_stops_on_ctrl_c():
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeserve.cli", "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--num-cpus", "2", "--draft", "none"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    output: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C to stop" in line for line in output):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(output)
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert any(f"http://127.0.0.1:{http_port}/v1" in line for line in output)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                       json={"model": "demo-moe", "prompt": "Do you have rye bread?", "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8

        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 < 30
        while not lines.empty():
            output.append(lines.get())
        assert any("stopping..." in line for line in output)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
