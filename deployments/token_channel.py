"""Tokens from the engine replica straight to the gateway (`gateway.direct_tokens`).

A request still takes one Serve call, `EngineServer.generate_direct`, which keeps Serve's routing,
backpressure and autoscaling (the call stays open while the request runs), but its tokens bypass
Ray: the call's first item is the replica's token socket, and every gateway replica keeps one
persistent connection to each engine replica it uses, on which each engine step's chunks for that
gateway's requests arrive as one message (`multiprocessing.connection`: length-prefixed frames,
HMAC handshake with the replica's secret). Chunks the replica makes itself (a refusal, a deadline, a
dead core) come on the Serve call. A request ends at its first finished chunk from either path; a
closed connection ends its requests with UNAVAILABLE, which the gateway resumes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from moeserve.errors import ErrorCode
from moeserve.protocol import GenerateChunk, error_chunk, hand_over, paced

log = logging.getLogger(__name__)

LAST_CHUNK_GRACE_S = 5.0  # after the Serve call ends, how long the socket may still take to bring the last chunk


@dataclass(frozen=True)
class TokenSocket:
    """Where a direct request's chunks come from: the engine replica's address and secret."""

    address: tuple[str, int]
    authkey: bytes


class TokenServer:
    """In the engine replica: accepts gateways' connections (each says its id first) and sends each
    its requests' chunks, one message per engine step."""

    def __init__(self) -> None:
        self.authkey = os.urandom(16)
        self._listener = Listener((node_ip(), 0), authkey=self.authkey)
        self.socket = TokenSocket(self._listener.address, self.authkey)
        self._lock = threading.Lock()
        self._conns: dict[str, Connection] = {}
        self._joined = threading.Condition(self._lock)
        threading.Thread(target=self._accept, daemon=True, name="token-socket").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
                gateway = conn.recv()
            except OSError:  # closed
                return
            except Exception as e:  # a failed handshake (wrong key) or hello: keep listening
                log.warning("token socket: refused a connection: %s", e)
                continue
            no_delay(conn)
            with self._lock:
                old = self._conns.pop(gateway, None)
                self._conns[gateway] = conn
                self._joined.notify_all()
            if old is not None:  # the gateway reconnected: its old connection is dead to it
                old.close()

    def wait_for(self, gateway: str, timeout: float) -> bool:
        """Whether `gateway` is connected, waiting up to `timeout` seconds for it."""
        with self._lock:
            return self._joined.wait_for(lambda: gateway in self._conns, timeout)

    def send(self, by_gateway: dict[str, list[GenerateChunk]]) -> list[str]:
        """Each gateway's chunks in one message; returns the gateways that could not be reached (dropped)."""
        lost = []
        for gateway, chunks in by_gateway.items():
            with self._lock:
                conn = self._conns.get(gateway)
            try:
                if conn is None:
                    raise OSError("not connected")
                conn.send_bytes(pickle.dumps(chunks, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                lost.append(gateway)
                with self._lock:
                    if conn is not None and self._conns.get(gateway) is conn:
                        del self._conns[gateway]
        return lost

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()


class TokenClient:
    """In the gateway: one connection per engine replica, read by a thread that hands each chunk to
    its request's queue. `generate` runs one request over a streaming Serve handle, pacing a stream
    after its first token as the replica paces its own streams: `interval(live requests)` seconds
    between chunks (`EngineSection.stream_interval`), the backlog coalesced into one."""

    def __init__(self, interval: Callable[[int], float] = lambda live: 0.0) -> None:
        self.id, self.interval = uuid.uuid4().hex, interval
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # one connection at a time
        self._conns: dict[tuple[str, int], Connection] = {}
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, tuple[str, int] | None]] = {}

    async def generate(self, stream_handle: Any, request: Any) -> AsyncIterator[GenerateChunk]:
        rid, loop, chunks = request.request_id, asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            self._waiting[rid] = (loop, chunks, None)
        response = stream_handle.generate_direct.remote(request, self.id)
        finished, first, serve_side = False, True, None
        try:
            first = await anext(response)
            if isinstance(first, GenerateChunk):  # refused at admission
                finished = True
                yield first
                return
            await self._connect(first, rid)
            serve_side = asyncio.ensure_future(self._serve_side(response, chunks, rid))
            while not finished:
                chunk = await paced(await chunks.get(), chunks, self.interval(len(self._waiting)), first)
                finished, first = chunk.finished, False
                yield chunk
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
            if serve_side is not None:
                serve_side.cancel()
            if not finished:
                response.cancel()

    @staticmethod
    async def _serve_side(response: Any, chunks: asyncio.Queue, rid: str) -> None:
        """What comes on the Serve call after the socket (errors the replica made); a failed call
        ends the request; once the call ends, the socket has a last while to bring the final chunk."""
        try:
            async for chunk in response:
                chunks.put_nowait(chunk)
        except Exception as e:  # a dead replica
            chunks.put_nowait(error_chunk(rid, ErrorCode.UNAVAILABLE, f"engine call failed: {type(e).__name__}: {e}"))
            return
        await asyncio.sleep(LAST_CHUNK_GRACE_S)
        chunks.put_nowait(error_chunk(rid, ErrorCode.UNAVAILABLE, "the engine call ended without a last chunk"))

    async def _connect(self, socket_: TokenSocket, rid: str) -> None:
        address = tuple(socket_.address)
        with self._lock:
            known = address in self._conns
        if not known:  # one connection per replica: a second would replace the first there
            await asyncio.to_thread(self._open, address, socket_.authkey)
        with self._lock:
            if rid in self._waiting:
                loop, chunks, _ = self._waiting[rid]
                self._waiting[rid] = (loop, chunks, address)

    def _open(self, address: tuple[str, int], authkey: bytes) -> None:
        with self._opening:
            if address in self._conns:
                return
            conn = Client(address, authkey=authkey)
            no_delay(conn)
            conn.send(self.id)
            with self._lock:
                self._conns[address] = conn
        threading.Thread(target=self._read, args=(address, conn), daemon=True, name="token-reader").start()

    def _read(self, address: tuple[str, int], conn: Connection) -> None:
        try:
            while True:
                self._deliver(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError) as e:
            reason = f"the engine replica's token socket closed: {type(e).__name__}"
        with self._lock:
            if self._conns.get(address) is conn:
                del self._conns[address]
            lost = [rid for rid, (_, _, a) in self._waiting.items() if a == address]
        conn.close()
        self._deliver([error_chunk(rid, ErrorCode.UNAVAILABLE, reason) for rid in lost])

    def _deliver(self, chunks: list[GenerateChunk]) -> None:
        with self._lock:  # a request that ended is not waiting (a cancelled one's abort comes after it)
            waiting = [(self._waiting[c.request_id][:2], c) for c in chunks if c.request_id in self._waiting]
        hand_over([(loop, queue, chunk) for (loop, queue), chunk in waiting])

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()


def no_delay(conn: Connection) -> None:
    """Small messages go out at once (TCP_NODELAY), not after the peer's delayed acknowledgement."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def node_ip() -> str:
    """This node's address as Ray knows it (other nodes can reach it), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not on Ray
        pass
    return socket.gethostbyname("localhost")
