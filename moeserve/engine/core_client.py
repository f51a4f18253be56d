"""The engine core's two homes, behind one client: a thread of this process, or a process of its own.

`ProcessCore` (the served default) runs EngineCore.run in a child process, sharing no GIL with
Serve's event loop, over a Unix socket pair. A dead core closes its end, so the client notices at
once, tells `on_dead`, and starts a fresh core; messages sent meanwhile wait in a backlog.
`InprocCore` runs the same loop on a thread: for tests, and for cores that need this process's Ray
handles (an expert-parallel rank 0).
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from moeserve.engine.core import EngineCore
from moeserve.protocol import CoreReady, CoreStopped, Shutdown, StatsReply, StatsRequest

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large checkpoint may take minutes


class CoreClient(ABC):
    """What both homes share: the stats round trip and the routing of what the core sends."""

    def __init__(self, on_message: Callable[[Any], None], on_dead: Callable[[str], None]) -> None:
        self.on_message, self.on_dead = on_message, on_dead
        self.dead: str | None = None  # why the core is gone for good
        self.restarts = 0  # cores started again after one died (a process core)
        self._tokens = itertools.count()
        self._replies: dict[int, tuple[threading.Event, list]] = {}

    @abstractmethod
    def send(self, msg: Any) -> None:
        """Post a message to the core (never blocks on the core's loop)."""

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def close(self, timeout: float = 5.0) -> None: ...

    @property
    def why_stopped(self) -> str | None:
        """Why the core is gone (None while it runs, or after a plain close)."""
        return self.dead

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The core's gauges; raises TimeoutError if it does not answer (busy or gone)."""
        token, done = next(self._tokens), threading.Event()
        self._replies[token] = (done, box := [])
        try:
            self.send(StatsRequest(token))
            if not done.wait(timeout):
                raise TimeoutError(f"the engine core did not answer within {timeout:g} s")
            return box[0]
        finally:
            self._replies.pop(token, None)

    def _receive(self, msg: Any) -> None:
        if isinstance(msg, StatsReply):
            waiting = self._replies.get(msg.token)
            if waiting is not None:
                waiting[1].append(msg.stats)
                waiting[0].set()
        elif isinstance(msg, CoreStopped):
            self._stopped(msg.reason)
        elif msg:
            try:
                self.on_message(msg)
            except Exception as e:  # a broken handler must not wedge the replica quietly: it fails health, restarts
                logger.exception("handling the engine core's output failed")
                self._stopped(f"handling the engine core's output failed: {type(e).__name__}: {e}")

    def _stopped(self, reason: str) -> None:
        self.dead = reason
        self.on_dead(reason)


class _QueueChannel:
    """The core's side of an in-process channel."""

    def __init__(self, inbox: queue.SimpleQueue, deliver: Callable[[Any], None]) -> None:
        self.inbox, self.send = inbox, deliver

    def recv(self, timeout: float | None) -> Any | None:
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None


class InprocCore(CoreClient):
    """The core on a thread of this process; `core.engine` stays reachable (tests, shard groups)."""

    def __init__(self, core: EngineCore, on_message: Callable, on_dead: Callable) -> None:
        super().__init__(on_message, on_dead)
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        channel = _QueueChannel(self._inbox, self._receive)
        self._thread = threading.Thread(target=core.run, args=(channel,), name="engine-core", daemon=True)
        self._thread.start()

    def send(self, msg: Any) -> None:
        self._inbox.put(msg)

    @property
    def alive(self) -> bool:
        # the core's own flag first: its failed streams may reach their readers before CoreStopped does
        return self.dead is None and self.core.stop_reason is None and self._thread.is_alive()

    @property
    def why_stopped(self) -> str | None:
        return self.dead or self.core.stop_reason

    def close(self, timeout: float = 5.0) -> None:
        self.send(Shutdown())
        self._thread.join(timeout)


class _ConnChannel:
    """The core's side of the socket: pickled messages; a closed socket reads as Shutdown."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self, timeout: float | None) -> Any | None:
        try:
            if not self.conn.poll(timeout):
                return None
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):  # the client is gone: stop
            return Shutdown()


class ProcessCore(CoreClient):
    """The core in a child process (built there by `build_core(spec)`); restarted when it dies, until `close()`."""

    def __init__(self, spec: Any, on_message: Callable, on_dead: Callable) -> None:
        super().__init__(on_message, on_dead)
        self.spec = spec
        self.pid: int | None = None
        self._lock = threading.Lock()  # guards _conn, _backlog, _ready
        self._ready = threading.Event()
        self._backlog: list[Any] = []
        self._closing = False
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._start()
        if not self._ready.wait(START_TIMEOUT_S) or self.dead:
            self.close()
            raise RuntimeError(f"the engine core did not start: {self.dead or 'timed out'}")

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._closing

    def send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._ready.is_set():
                try:
                    self._conn.send_bytes(data)
                    return
                except OSError:  # died just now: the reader thread restarts it and replays the backlog
                    self._ready.clear()
            self._backlog.append(data)

    def kill(self) -> None:
        """SIGKILL the core process (fault injection)."""
        if self._proc is not None:
            self._proc.kill()

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        proc = self._proc
        if proc is None:
            return
        try:
            self.send(Shutdown())
            proc.wait(timeout)
        except (subprocess.TimeoutExpired, OSError):
            proc.kill()

    # ---- the child ---------------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen([sys.executable, "-m", "moeserve.engine.core_client", str(child.fileno())],
                                pass_fds=(child.fileno(),), env=env)
        child.close()
        conn = Connection(parent.detach())
        conn.send_bytes(pickle.dumps(self.spec))
        with self._lock:
            self._proc, self._conn, self.pid = proc, conn, proc.pid
            self._ready.clear()
        threading.Thread(target=self._read, args=(proc, conn), name="engine-core-reader", daemon=True).start()

    def _read(self, proc: subprocess.Popen, conn: Connection) -> None:
        reason = "engine core process exited"
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                if isinstance(msg, CoreReady):
                    with self._lock:
                        for data in self._backlog:
                            conn.send_bytes(data)
                        self._backlog.clear()
                        self._ready.set()
                elif isinstance(msg, CoreStopped):
                    reason = msg.reason
                else:
                    self._receive(msg)
        except (EOFError, OSError):
            pass
        started = self._ready.is_set()
        with self._lock:
            self._ready.clear()  # from now on, messages wait in the backlog for the next core
        code = proc.wait()
        conn.close()
        if self._closing:
            return
        reason = f"{reason} (exit code {code})"
        logger.error("%s; restarting it", reason)
        self.on_dead(reason)  # every live stream ends with UNAVAILABLE: the gateway resumes them
        if not started:  # it never came up: a second try would fail the same way
            self.dead = reason
            self._ready.set()
            return
        self.restarts += 1
        self._start()


def build_core(spec: Any) -> EngineCore:
    """The child's core from its spec: the config tree, torch threads, and optionally the
    engine's proposer (a draft deployment's, which connects to its channel on first use)."""
    import torch

    from moeserve.engine.factory import build_engine
    from moeserve.grammar import GrammarCompiler

    config, torch_threads, *rest = spec
    proposer = rest[0] if rest else None
    # unset: leave a core to the serving processes (the replica, the gateway, HAProxy)
    torch.set_num_threads(torch_threads or max(1, torch.get_num_threads() - 1))
    engine = build_engine(config, proposer=proposer)
    grammar = config.grammar.grammar_config()
    return EngineCore(engine, GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, config=grammar))


def main(fd: int) -> None:
    """The core process: read the spec, build the core, say ready, run until told to stop."""
    logging.basicConfig(level=logging.INFO, format="engine-core %(levelname)s %(message)s")
    conn = Connection(fd)
    core = build_core(pickle.loads(conn.recv_bytes()))
    channel = _ConnChannel(conn)
    channel.send(CoreReady(os.getpid(), core.engine.scheduler.cfg.max_num_seqs))
    core.run(channel)


if __name__ == "__main__":
    main(int(sys.argv[1]))
