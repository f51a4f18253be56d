"""`moeserve serve` end to end, as a user runs it: it starts a local Ray, deploys the demo app,
prints its URLs, answers, and stops cleanly when Ctrl-C reaches its process group."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import jsonschema

from deployments.local import DEMO_SCHEMA
from model_shards.local_group import free_port

ROOT = Path(__file__).resolve().parents[2]


def serve_and_stop(command: list[str], cwd: Path, check: Callable[[int, Callable[[], list[str]]], None],
                   extra: tuple[str, ...] = ()) -> list[str]:
    """Run `command serve ... extra` in its own process group, wait for its URLs, `check(http_port,
    read)` (read() returns the output so far), then Ctrl-C it and require a clean exit within 30 s."""
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [*command, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--num-cpus", "2",
         "--draft", "none", *extra],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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

        def read() -> list[str]:
            while not lines.empty():
                output.append(lines.get())
            return output

        check(http_port, read)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=60) == 0, "".join(output + [lines.get() for _ in range(lines.qsize())])
        assert time.monotonic() - t0 < 30
        while not lines.empty():
            output.append(lines.get())
        assert any("stopping..." in line for line in output)
        return output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_moeserve_serve_answers_and_stops_on_ctrl_c():
    def check(http_port: int, read) -> None:
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                       json={"model": "demo-moe", "prompt": "Do you have rye bread?", "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8

    serve_and_stop([sys.executable, "-m", "deployments.cli"], ROOT, check)


def test_a_plain_pip_install_serves_the_demo(tmp_path, monkeypatch):
    """`pip install .` (not editable) into a fresh venv, then `moeserve serve --demo` from another
    folder: the demo checkpoints and the config come from the installed package, not the checkout."""
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the checkout's egg-info would read as "already installed"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # the dependencies come from this environment (no downloads); moeserve itself is installed fresh
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    # `pip install .` = build the wheel (with this environment's setuptools, from a copy: the build
    # writes into the source folder), then install it into the venv
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                 "bench"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path, timeout=600)
    wheel = next((tmp_path / "dist").glob("moeserve-*.whl"))
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                   check=True, cwd=tmp_path, timeout=600)
    assert (site / "moeserve" / "checkpoints" / "demo-moe" / "model.safetensors").is_file()
    assert (site / "deployments" / "playground" / "index.html").is_file()  # GET /playground's page
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import moeserve.config as c; print(c.DATA_ROOT)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == site / "moeserve"

    def demo_answered(http_port: int, read) -> None:
        deadline = time.monotonic() + 120
        while not (answers := [line.strip() for line in read() if line.strip().startswith("{")]):
            assert time.monotonic() < deadline, "".join(read())
            time.sleep(0.5)
        jsonschema.validate(json.loads(answers[0]), DEMO_SCHEMA)  # the demo's streamed, schema-bound answer

    serve_and_stop([str(venv / "bin" / "moeserve")], tmp_path, demo_answered, extra=("--demo",))
