"""The engine's persistent data channel to its draft worker: one socket, set up once through Ray.

    engine step --pickled DraftCall--> socket --> DraftWorker (its channel thread)
                <--proposals----------
                <--Push(pre-drafts)--            (unasked, once the worker has drafted ahead)
                --Notice(DraftCall)->            (no reply: the step used a pushed pre-draft)

A Ray actor call costs milliseconds here, about as much as a decode step, so the per-step
traffic does not go through Ray: the engine asks the worker once (a Ray call) to open a
channel and gets its address and a one-time secret, connects, and then every step is one
message each way over that connection (`multiprocessing.connection`: length-prefixed
frames, HMAC handshake with the secret, so nothing else can connect). If the worker dies, the
connection breaks at once; the engine forgets it and asks the deployment for a worker again.

A call's round trip still costs the step: the worker wakes, reads, answers, the engine reads
(bench/reports/speculative.md gives the wait per call), and a call that arrives while the
worker still drafts ahead waits for it. So what the worker drafts ahead is pushed to the engine as soon as it is
drafted; a step that finds its proposals there uses them at once and tells the worker which
ones with a notice, which is not answered.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class Notice:
    """An engine's message that is handled like a call but not answered."""

    msg: Any


@dataclass(frozen=True)
class Push:
    """What the worker's after-hook returned, sent to the engine unasked."""

    payload: Any


class ChannelServer:
    """In the draft worker: accepts engines' connections, one thread each. Per message,
    `handle(msg)` gives the reply, which is sent at once (not for a `Notice`); then
    `after(msg, reply, peek, push)` runs (the worker's pre-drafting) while the engine is busy
    with its own step. `peek()` is the engine's next message once it has arrived (None before):
    `after` may stop early for it, and it is handled as soon as `after` returns. `push(payload)`
    sends a payload to the engine unasked (`Push`; nothing for an empty one), unless its next
    call has arrived already (that one is answered from what `after` did)."""

    def __init__(self, handle: Callable[[Any], Any],
                 after: Callable[[Any, Any, Callable[[], Any], Callable[[Any], None]], None] | None = None,
                 host: str | None = None) -> None:
        self.handle, self.after = handle, after
        self.authkey = os.urandom(16)
        bind = host or _node_ip()
        self._listener = Listener((bind, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address
        self.num_connections = 0
        threading.Thread(target=self._accept, daemon=True, name="draft-channel").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            except Exception as e:  # a failed handshake (wrong key): keep listening
                log.warning("draft channel: refused a connection: %s", e)
                continue
            self.num_connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        _no_delay(conn)
        early: list[Any] = []  # the next message, when `after` peeked at it

        def send_push(payload: Any) -> None:  # unless the engine's next call is here: it is answered
            waiting = peek()
            if payload and (waiting is None or isinstance(waiting, Notice)):
                conn.send_bytes(_dumps(Push(payload)))

        def peek() -> Any:
            if not early and conn.poll(0):
                early.append(pickle.loads(conn.recv_bytes()))
            return early[0] if early else None

        with conn:
            while True:
                try:
                    msg = early.pop() if early else pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the engine went away
                    return
                try:
                    notice = isinstance(msg, Notice)
                    if notice:
                        msg = msg.msg
                    reply = self.handle(msg)
                    if not notice:
                        conn.send_bytes(_dumps(reply))
                    if self.after is not None:
                        self.after(msg, reply, peek, lambda payload: send_push(payload))
                except (EOFError, OSError):
                    return
                except Exception:  # a bug in the handler: drop this engine's connection (it falls back)
                    log.exception("draft channel: a call failed; closing the connection")
                    return

    def close(self) -> None:
        self._listener.close()


class ChannelClient:
    """The engine's end: `call(msg, timeout_s)` sends one message and waits for its reply;
    `notify(msg)` sends one that is not answered; `pushed()` gives what the worker pushed."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self._conn = Client(tuple(address), authkey=authkey)
        _no_delay(self._conn)
        self._pushes: list[Any] = []

    def call(self, msg: Any, timeout_s: float) -> Any:
        """The reply; TimeoutError if none within timeout_s (the connection is then unusable:
        a late reply would answer the next call), OSError/EOFError if the worker is gone.
        Pushes that arrive first are kept for `pushed()`."""
        self._conn.send_bytes(_dumps(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no reply on the draft channel within {timeout_s} s")
            got = pickle.loads(self._conn.recv_bytes())
            if not isinstance(got, Push):
                return got
            self._pushes.append(got.payload)

    def notify(self, msg: Any) -> None:
        """Sends msg as a `Notice`: handled like a call, not answered."""
        self._conn.send_bytes(_dumps(Notice(msg)))

    def pushed(self) -> list[Any]:
        """The payloads pushed since the last time, oldest first (never waits)."""
        while self._conn.poll(0):
            got = pickle.loads(self._conn.recv_bytes())
            if isinstance(got, Push):
                self._pushes.append(got.payload)
            else:  # only a call's reply, and calls wait for theirs
                log.warning("draft channel: an unasked reply was dropped")
        out, self._pushes = self._pushes, []
        return out

    def close(self) -> None:
        self._conn.close()


def _no_delay(conn: Connection) -> None:
    """Small messages go out at once (TCP_NODELAY). Without it, a push right after a reply, or a
    call right after a notice, waited for the peer's delayed acknowledgement, a timer far longer
    than a decode step."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _node_ip() -> str:
    """This node's address as Ray knows it (other nodes can reach it), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not on Ray
        pass
    return socket.gethostbyname("localhost")
