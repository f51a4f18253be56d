"""The draft model as its own Serve deployment.

Each replica runs one `DraftWorker` in a child process (`DraftProcess`), started again whenever it
dies; an engine asks the deployment once (a Serve call) for its replica's data channel, whose
address and secret outlive the worker's restarts, and sends every step there. When a call times
out or fails, the engine decodes without drafts for a while (exact all the same), then reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from ray import serve
from ray.serve import Application

from deployments.draft_channel import RemoteDraftProposer
from deployments.draft_worker import DraftServerConfig
from deployments.token_channel import node_ip
from moeserve.config import DeploymentsSection

__all__ = ["DraftProcess", "DraftServer", "DraftServerConfig", "RemoteDraftProposer", "bind_draft"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a draft checkpoint may take a while on a busy node


class DraftProcess:
    """A DraftWorker in a child process, restarted whenever it dies until `close()`, each child on
    the same channel address (`address`, `authkey`); `stats()`/`check()` ask it over a control
    socket. If a restart fails, `dead` says why."""

    def __init__(self, config: DraftServerConfig, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.config, self.start_timeout_s = config, start_timeout_s
        self.address: tuple[str, int] = (node_ip(), 0)  # port 0: the first child picks one
        self.authkey = os.urandom(16)
        self.restarts = 0
        self.dead: str | None = None
        self.pid: int | None = None
        self._lock = threading.Lock()  # one control round trip at a time; guards _proc and _conn
        self._ready = threading.Event()
        self._closing = False
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self, restart: bool = False) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen([sys.executable, "-m", "deployments.draft_worker", str(child.fileno())],
                                pass_fds=(child.fileno(),), env=env)
        child.close()
        conn = Connection(parent.detach())
        try:
            conn.send_bytes(pickle.dumps((self.config, self.address, self.authkey)))
            if not conn.poll(self.start_timeout_s):
                raise TimeoutError(f"not ready within {self.start_timeout_s} s")
            pid, address = pickle.loads(conn.recv_bytes())
        except Exception as e:  # it died while loading (EOFError), or hangs
            proc.kill()
            proc.wait()
            conn.close()
            raise RuntimeError(f"the draft worker process did not start: {type(e).__name__}: {e}") from e
        with self._lock:
            self._proc, self._conn, self.pid, self.address = proc, conn, pid, tuple(address)
            self.restarts += restart
            self._ready.set()
        threading.Thread(target=self._watch, args=(proc,), name="draft-worker-watch", daemon=True).start()

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._ready.clear()
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        if self._closing:
            return
        log.error("the draft worker process exited (code %s); starting a new one", code)
        try:
            self._start(restart=True)
        except Exception as e:
            self.dead = str(e)
            log.error("%s", e)

    def _ask(self, op: str, timeout_s: float) -> Any:
        with self._lock:
            if self._conn is None:
                raise RuntimeError(self.dead or "the draft worker process is restarting")
            self._conn.send_bytes(op.encode())
            if not self._conn.poll(timeout_s):
                raise TimeoutError(f"the draft worker process did not answer {op!r} within {timeout_s} s")
            return pickle.loads(self._conn.recv_bytes())

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The worker's counters, its pid and how often it was restarted."""
        return self._ask("stats", timeout_s) | {"pid": self.pid, "restarts": self.restarts}

    def check(self, timeout_s: float = 10.0) -> None:
        """Raises when the worker is dead for good, or up and not answering; a restart in progress passes."""
        if self.dead:
            raise RuntimeError(self.dead)
        if self._ready.is_set():
            self._ask("ping", timeout_s)

    def kill(self) -> None:
        """SIGKILL the child (fault injection): it is restarted like any other death."""
        if self._proc is not None:
            self._proc.kill()

    def close(self) -> None:
        self._closing = True
        if self._proc is not None:
            self._proc.kill()


class DraftServer:
    """A draft replica: supervises its worker's process and tells engines where its channel is.
    The child runs with the replica's reservation (its node, CPUs, and GPU: `CUDA_VISIBLE_DEVICES`
    is inherited)."""

    def __init__(self, config: DraftServerConfig) -> None:
        self._process = DraftProcess(config)  # the model is loaded before the replica reports ready

    async def channel(self) -> tuple[tuple[str, int], bytes]:
        """The address and secret of the worker's data channel."""
        return self._process.address, self._process.authkey

    async def stats(self) -> dict[str, Any]:
        """This replica's worker's counters."""
        return await asyncio.to_thread(self._process.stats)

    async def check_health(self) -> None:
        """Serve's health-check hook: a replica whose worker cannot be restarted gets replaced."""
        await asyncio.to_thread(self._process.check)

    def __del__(self) -> None:
        self._process.close()


def bind_draft(config: DraftServerConfig, serve_options: dict[str, Any] | None = None,
               name: str = "draft") -> Application:
    """The draft deployment, bound, for the engine deployment's bind(). `serve_options`: the
    config's `deployments.draft` (replicas or autoscaling, admission, resources)."""
    options = serve_options or DeploymentsSection().draft.serve_options()
    return serve.deployment(DraftServer, name=name, **options).bind(config)
