"""The persistent data channel between an engine and its draft worker, and the engine's end of it.

A Serve call costs more than a decode step, so per-step traffic bypasses Ray: after one Serve call
for the channel's address and secret, every step is one `DraftCall` and one list of Proposals
(`multiprocessing.connection`: length-prefixed frames, HMAC handshake with the secret).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from deployments.token_channel import no_delay
from moeserve.protocol import DraftCall
from moeserve.spec.proposer import Proposal, ProposalRequest, Proposer

log = logging.getLogger(__name__)


class ChannelServer:
    """In the draft worker: accepts engines' connections, one thread each. Per message, the
    reply `handle(msg)` is sent at once; then `after(msg, reply)` runs (the worker's pre-drafting)
    while the engine verifies."""

    def __init__(self, handle: Callable[[Any], Any], after: Callable[[Any, Any], None],
                 address: tuple[str, int], authkey: bytes) -> None:
        self.handle, self.after = handle, after
        self._listener = Listener(address, authkey=authkey)
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
        no_delay(conn)
        with conn:
            while True:
                try:
                    msg = pickle.loads(conn.recv_bytes())
                    reply = self.handle(msg)
                    conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                    self.after(msg, reply)
                except (EOFError, OSError):  # the engine went away
                    return
                except Exception:  # a bug in the handler: drop this engine's connection (it falls back)
                    log.exception("draft channel: a call failed; closing the connection")
                    return


class RemoteDraftProposer(Proposer):
    """Engine-side proposer: one `DraftCall` per engine step over the data channel. channel: the
    worker's (address, secret), or a function that asks for it within a timeout (asked again after a
    failure). After a failure no call for backoff_s, doubling per further failure up to max_backoff_s;
    meanwhile steps decode without drafts."""

    def __init__(self, channel: tuple[tuple[str, int], bytes] | Callable[[float], Any], timeout_s: float = 0.5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        if timeout_s <= 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError("need timeout_s > 0 and 0 <= backoff_s <= max_backoff_s")
        self._channel = channel
        self.session = uuid.uuid4().hex[:12]  # two engines never share a draft cache entry
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self._pause_s, self._retry_at = backoff_s, 0.0
        self._conn: Connection | None = None
        self._finished: deque[str] = deque(maxlen=100_000)  # the worker evicts least recently used ones anyway
        self.num_calls = self.num_proposals = self.num_predraft_hits = 0
        self.num_fallback_steps = self.num_timeouts = self.num_errors = 0
        self.draft_wait_s = 0.0

    def __getstate__(self) -> dict[str, Any]:  # pickled into an engine core's spec before it connects
        return {**self.__dict__, "_conn": None}

    def connect(self, timeout_s: float) -> bool:
        """Opens the channel now (so that no step pays for it); whether it is open."""
        try:
            if self._conn is None:
                channel = self._channel if isinstance(self._channel, tuple) else self._channel(timeout_s)
                self._conn = Client(tuple(channel[0]), authkey=channel[1])
                no_delay(self._conn)
        except Exception as e:
            log.warning("draft channel not open yet (%s: %s); trying again on a later step", type(e).__name__, e)
        return self._conn is not None

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Drafts for the batch, or none at all (fallback) when the worker is slow or gone."""
        empty = [Proposal([]) for _ in requests]
        asked = [r for r in requests if r.num_tokens > 0]
        if not asked:
            return empty
        if time.monotonic() < self._retry_at:
            self.num_fallback_steps += 1
            return empty
        self.num_calls += 1
        finished, prefix = list(self._finished), self.session + "/"
        self._finished.clear()
        call = DraftCall([ProposalRequest(prefix + r.seq_id, r.token_ids, r.num_tokens, r.params) for r in asked],
                         [prefix + s for s in finished])
        t0 = time.perf_counter()
        try:
            got = self._call(call)
        except Exception as e:  # timed out, the worker died, the deployment is gone: never fail the step
            self._fail(finished, e)
            return empty
        finally:
            self.draft_wait_s += time.perf_counter() - t0
        self._pause_s = self.backoff_s
        self.num_proposals += sum(1 for p in got if p.token_ids)
        self.num_predraft_hits += sum(1 for p in got if p.predrafted)
        by_id = dict(zip((r.seq_id for r in asked), got))
        return [by_id.get(r.seq_id, p) for r, p in zip(requests, empty)]

    def _call(self, call: DraftCall) -> list[Proposal]:
        if self._conn is None and not self.connect(self.timeout_s):
            raise ConnectionError("the draft channel is not open")
        self._conn.send_bytes(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"no drafts within {self.timeout_s} s")
        return pickle.loads(self._conn.recv_bytes())

    def _fail(self, finished: list[str], error: Exception) -> None:
        if self._conn is not None:  # a late reply would answer the next call: start afresh
            self._conn.close()
            self._conn = None
        self.num_timeouts += isinstance(error, TimeoutError)
        self.num_errors += not isinstance(error, TimeoutError)
        self.num_fallback_steps += 1
        self._finished.extendleft(reversed(finished))  # sent again next time (freeing twice is harmless)
        self._retry_at = time.monotonic() + self._pause_s
        log.warning("draft deployment %s: %s; decoding without drafts for %.1f s", type(error).__name__, error,
                    self._pause_s)
        self._pause_s = min(self._pause_s * 2, self.max_backoff_s)

    def on_finished(self, seq_id: str) -> None:
        """Queued; sent with the next call."""
        self._finished.append(seq_id)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics (`moeserve_engine{name="draft_..."}`)."""
        return {"calls": self.num_calls, "proposals": self.num_proposals, "predraft_hits": self.num_predraft_hits,
                "predraft_hit_rate": self.num_predraft_hits / max(self.num_proposals, 1),
                "fallback_steps": self.num_fallback_steps, "timeouts": self.num_timeouts, "errors": self.num_errors,
                "wait_s": self.draft_wait_s, "wait_s_per_call": self.draft_wait_s / max(self.num_calls, 1)}
