"""The draft worker's process, seen from its replica: `DraftProcess` starts
`python -m deployments.draft_worker` (deployments/draft_worker.py `main`), asks it for its data
channel, its counters and a ping over a control socket, and starts a new one whenever it dies."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from deployments.draft_worker import DraftServerConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a draft checkpoint may take a while on a busy node


class DraftProcess:
    """A DraftWorker in a child process (`python -m deployments.draft_worker FD`), started at
    once and again whenever it dies, until `close()`.

    `address`/`authkey`: the current child's data channel; `stats()`/`ping()` ask it over the
    control socket. If a restart fails, `dead` says why (the replica then reports unhealthy and
    Serve replaces it).
    """

    def __init__(self, config: DraftServerConfig, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.config, self.start_timeout_s = config, start_timeout_s
        self.restarts = 0
        self.dead: str | None = None
        self.pid: int | None = None
        self.address: tuple[str, int] | None = None
        self.authkey = b""
        self._lock = threading.Lock()  # one control round trip at a time; guards the fields above
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
            conn.send_bytes(pickle.dumps(self.config))
            if not conn.poll(self.start_timeout_s):
                raise TimeoutError(f"not ready within {self.start_timeout_s} s")
            pid, address, authkey = pickle.loads(conn.recv_bytes())
        except Exception as e:  # it died while loading (EOFError), or hangs
            proc.kill()
            proc.wait()
            conn.close()
            raise RuntimeError(f"the draft worker process did not start: {type(e).__name__}: {e}") from e
        with self._lock:
            self._proc, self._conn = proc, conn
            self.pid, self.address, self.authkey = pid, tuple(address), authkey
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

    def channel(self, timeout_s: float) -> tuple[tuple[str, int], bytes]:
        """The data channel's address and secret, once a child is up (TimeoutError otherwise).
        Right after a child dies, and before this notices, it may still name the dead one's."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(self.dead or f"the draft worker is not up within {timeout_s} s (restarting)")
        return self.address, self.authkey

    def _ask(self, op: str, timeout_s: float) -> Any:
        with self._lock:
            if self._conn is None:
                raise RuntimeError(self.dead or "the draft worker process is restarting")
            self._conn.send_bytes(op.encode())
            if not self._conn.poll(timeout_s):
                raise TimeoutError(f"the draft worker process did not answer {op!r} within {timeout_s} s")
            return pickle.loads(self._conn.recv_bytes())

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The worker's counters, with this process's pid and how often it was restarted."""
        return self._ask("stats", timeout_s) | {"pid": self.pid, "restarts": self.restarts}

    def check(self, timeout_s: float = 10.0) -> None:
        """Raises when the worker is dead for good, or up and not answering; a restart in
        progress passes (the replica stays healthy while its worker comes back)."""
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
