"""The draft deployment's worker: the draft model answering each engine step's `DraftCall`, and
pre-drafting each row's next proposal while the target verifies. It runs in a child process of its
replica, not in a Ray process, so its channel threads share the GIL with nothing but the model.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from moeserve.config import EngineSection, default_of
from moeserve.protocol import DraftCall
from moeserve.spec.proposer import Proposal, ProposalRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftServerConfig:
    """What a draft replica loads. greedy: see DraftModelProposer (False samples drafts for sampled
    requests and returns q, which then crosses the wire; nothing is pre-drafted then). cpus: pin
    the worker process to these CPU ids (None: wherever the OS puts it)."""

    model_path: str
    max_num_seqs: int = default_of(EngineSection, "max_num_seqs")
    max_model_len: int = default_of(EngineSection, "max_model_len")
    greedy: bool = True
    torch_threads: int | None = None
    device: str = "auto"  # the draft's own GPU when the replica has one (ray_actor_options num_gpus)
    dtype: str = "auto"
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: the draft checkpoint folder is required")
        if min(self.max_num_seqs, self.max_model_len) < 1 or (self.torch_threads or 1) < 1:
            raise ValueError("max_num_seqs, max_model_len and torch_threads must be >= 1")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus: CPU ids >= 0, or None, got {self.cpus!r}")


class DraftWorker:
    """DraftModelProposer behind a lock (calls from several engines may overlap), with the
    proposals it drafted ahead, keyed by the history each assumes."""

    def __init__(self, config: DraftServerConfig) -> None:
        import torch

        from model_shards import load_checkpoint
        from model_shards.device import resolve_device, resolve_dtype
        from moeserve.engine.draft_model import DraftModelProposer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        device = resolve_device(config.device)
        model = load_checkpoint(config.model_path, resolve_dtype(config.dtype, device), device=device)
        self.proposer = DraftModelProposer(model, config.max_num_seqs, config.max_model_len, config.greedy)
        self._lock = threading.Lock()
        self._ahead: dict[str, tuple[tuple[int, ...], list[int]]] = {}  # seq -> (assumed history, tokens)
        self.channel: Any = None
        self.num_calls = self.num_predrafts = self.num_predraft_hits = 0
        self.busy_s = 0.0

    def propose(self, call: DraftCall) -> list[Proposal]:
        """Proposals for `call.requests`, in order: pre-drafted ones where the history is the one
        they assumed, the rest drafted now (batched)."""
        with self._lock:
            t0 = time.perf_counter()
            for seq_id in call.finished:
                self.proposer.on_finished(seq_id)
                self._ahead.pop(seq_id, None)
            out: list[Proposal | None] = [None] * len(call.requests)
            for i, r in enumerate(call.requests):
                history, tokens = self._ahead.pop(r.seq_id, ((), []))
                if tokens and history == tuple(r.token_ids):  # fewer than asked when k grew since: still free
                    out[i] = Proposal(tokens[: r.num_tokens], predrafted=True)
                    self.num_predraft_hits += 1
            todo = [i for i, p in enumerate(out) if p is None]
            for i, p in zip(todo, self.proposer.propose([call.requests[i] for i in todo]) if todo else []):
                out[i] = p
            self.num_calls += 1
            self.busy_s += time.perf_counter() - t0
            return out

    def predraft(self, call: DraftCall, proposals: list[Proposal]) -> None:
        """While the target verifies: each row's next proposal for the outcome that every draft is
        accepted and the bonus token is the draft's own, as one batched propose of k + 1 tokens.
        Sampled drafts are not drawn ahead of the request's own keyed noise."""
        guesses = [ProposalRequest(r.seq_id, list(r.token_ids) + p.token_ids, r.num_tokens + 1, r.params)
                   for r, p in zip(call.requests, proposals) if p.token_ids and r.num_tokens]
        if not guesses or not self.proposer.greedy:
            return
        with self._lock:
            self.num_predrafts += 1
            for g, p in zip(guesses, self.proposer.propose(guesses, hypothetical=True)):
                if len(p.token_ids) > 1:
                    self._ahead[g.seq_id] = (tuple(g.token_ids) + tuple(p.token_ids[:1]), p.token_ids[1:])

    def stats(self) -> dict[str, Any]:
        """This worker's counters."""
        p = self.proposer
        return {"calls": self.num_calls, "busy_s": self.busy_s, "tracked_seqs": p.num_tracked,
                "new_seqs": p.num_new_seqs, "rebuilt_tokens": p.num_rebuilt_tokens, "evictions": p.num_evictions,
                "predrafts": self.num_predrafts, "predraft_hits": self.num_predraft_hits,
                "channel_connections": self.channel.num_connections if self.channel is not None else 0,
                "cpus": sorted(os.sched_getaffinity(0))}


def main(fd: int) -> None:
    """The child: read the config and the channel's address and secret, load the model, open the
    channel, say where it is, then answer control requests (stats, ping) until the replica goes."""
    from deployments.draft_channel import ChannelServer

    logging.basicConfig(level=logging.INFO, format="draft-worker %(levelname)s %(message)s")
    conn = Connection(fd)
    config, address, authkey = pickle.loads(conn.recv_bytes())
    if config.cpus is not None:
        os.sched_setaffinity(0, config.cpus)
    worker = DraftWorker(config)
    worker.channel = ChannelServer(worker.propose, worker.predraft, address, authkey)
    conn.send_bytes(pickle.dumps((os.getpid(), worker.channel.address)))
    while True:
        try:
            op = conn.recv_bytes().decode()
        except (EOFError, OSError):
            os._exit(0)  # the replica is gone: so is this worker (its channel threads included)
        conn.send_bytes(pickle.dumps(worker.stats() if op == "stats" else True))


if __name__ == "__main__":
    from deployments import draft_worker  # this module under its own name, so what it pickles unpickles elsewhere

    draft_worker.main(int(sys.argv[1]))
