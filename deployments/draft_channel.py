"""The engine's persistent data channel to its draft worker: one socket, set up once through Ray.

    engine step --pickled DraftCall--> socket --> DraftWorker (its channel thread)
                <--proposals----------

A Ray actor call costs milliseconds here, about as much as a decode step, so the per-step
traffic does not go through Ray: the engine asks the worker once (a Ray call) to open a
channel and gets its address and a one-time secret, connects, and then every step is one
message each way over that connection (`multiprocessing.connection`: length-prefixed
frames, HMAC handshake with the secret, so nothing else can connect). If the worker dies, the
connection breaks at once; the engine forgets it and asks the deployment for a worker again.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class ChannelServer:
    """In the draft worker: accepts engines' connections, one thread each. Per message,
    `handle(msg)` gives the reply, which is sent at once; then `after(msg, reply, peek)` runs
    (the worker's pre-drafting) while the engine is busy with its own step. `peek()` is the
    engine's next message once it has arrived (None before): `after` may stop early for it,
    and it is handled as soon as `after` returns."""

    def __init__(self, handle: Callable[[Any], Any], after: Callable[[Any, Any, Callable[[], Any]], None] | None = None,
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
        early: list[Any] = []  # the next message, when `after` peeked at it

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
                    reply = self.handle(msg)
                    conn.send_bytes(_dumps(reply))
                    if self.after is not None:
                        self.after(msg, reply, peek)
                except (EOFError, OSError):
                    return
                except Exception:  # a bug in the handler: drop this engine's connection (it falls back)
                    log.exception("draft channel: a call failed; closing the connection")
                    return

    def close(self) -> None:
        self._listener.close()


class ChannelClient:
    """The engine's end: `call(msg, timeout_s)` sends one message and waits for its reply."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self._conn = Client(tuple(address), authkey=authkey)

    def call(self, msg: Any, timeout_s: float) -> Any:
        """The reply; TimeoutError if none within timeout_s (the connection is then unusable:
        a late reply would answer the next call), OSError/EOFError if the worker is gone."""
        self._conn.send_bytes(_dumps(msg))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"no reply on the draft channel within {timeout_s} s")
        return pickle.loads(self._conn.recv_bytes())

    def close(self) -> None:
        self._conn.close()


def _node_ip() -> str:
    """This node's address as Ray knows it (other nodes can reach it), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not on Ray
        pass
    return socket.gethostbyname("localhost")
