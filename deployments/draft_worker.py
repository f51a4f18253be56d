"""The draft deployment's worker: the draft model behind a lock, answering each engine step's
`DraftCall` and pre-drafting the next one while the target verifies (deployments/draft.py
places and routes to it; deployments/draft_channel.py carries its calls).

    DraftServer replica --DraftProcess (draft_process.py): control socket--> python -m
                    (ready, stats, ping)                                     deployments.draft_worker
    engine --data channel (address from the replica, once)----------------->  (DraftWorker + its
                                                                               ChannelServer)

The worker runs in a child process of its replica, not in a Ray process: there its channel
threads share the GIL with nothing but the model, where a Ray worker's own threads and a
replica's event loop would take turns with them on every step, so the same worker drafts faster
from a plain process than from a Ray actor. The child exits when its replica goes (the control
socket closes) and the replica starts a new child when it dies; engines then fetch the new
channel's address.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from deployments.draft_channel import Notice
from deployments.draft_grammar import GrammarMirror, RemoteGrammar
from moeserve.spec.proposer import Proposal, ProposalRequest

if TYPE_CHECKING:
    from moeserve.grammar.compiler import GrammarConfig

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DraftServerConfig:
    """What a draft replica loads. greedy: see DraftModelProposer (False samples drafts for
    sampled requests and returns q, which then crosses the wire: [k, V] floats per row)."""

    model_path: str
    max_num_seqs: int = 64
    max_model_len: int = 1024
    greedy: bool = True
    torch_threads: int | None = None
    device: str = "auto"  # the draft's own GPU when the replica has one (ray_actor_options num_gpus)
    dtype: str = "auto"
    predraft: bool = True  # draft the next proposal while the target verifies (DraftWorker.predraft)
    # Also pre-draft this many outcomes per row where a draft is rejected: at the positions where
    # the draft was least sure (its first choice's logit led its second's by the least), the
    # target's correction guessed to be the draft's second choice. Each is one more draft row: it
    # raises the share of rows answered from a pre-draft, but on a shared CPU core the rows cost
    # about what they save: for a draft on a GPU of its own, where a few more rows are nearly free.
    predraft_partial: int = 0
    # Pre-draft this many rounds ahead of the engine's step (with predraft): 1, the next proposal;
    # 2, also the one after it, assuming the next is accepted whole (PEARL's post-verify: the worker
    # drafts on while the target verifies, so the next step's proposals are pushed before it asks).
    predraft_rounds: int = 2
    # Pin the worker process to these CPU ids (os.sched_setaffinity); None: wherever the OS puts
    # it. On a small node a draft with a core of its own drafts ahead without pushing the
    # engine off its core (bench/reports/speculative.md).
    cpus: tuple[int, ...] | None = None
    # The engine's GrammarConfig (its JSON style and limits): constrained rows draft under the same
    # grammars the target is masked by (deployments/draft_grammar.py). None: the defaults.
    grammar: GrammarConfig | None = None

    def __post_init__(self) -> None:
        if self.predraft_partial < 0:
            raise ValueError(f"predraft_partial: >= 0, got {self.predraft_partial}")
        if self.predraft_rounds not in (1, 2):
            raise ValueError(f"predraft_rounds: 1 or 2, got {self.predraft_rounds}")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus: CPU ids >= 0, or None, got {self.cpus!r}")
        if not self.model_path:
            raise ValueError("model_path: the draft checkpoint folder is required")
        for name in ("max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads: must be >= 1, got {self.torch_threads}")


@dataclass(frozen=True)
class DraftCall:
    """One engine step's request to the draft deployment.

    requests: every drafting sequence of the step (ids already session-prefixed).
    finished: sequences that ended since the last call; their KV slots are freed first.
    ahead: the requests are sequences about to be prefilled (`Proposer.prepare`): answered at
        once with no drafts, then pre-drafted for the outcome that the target's first token is
        the draft's own.
    grammars: the constrained rows' grammars; the worker drafts them under matchers of its own.
    """

    requests: list[ProposalRequest]
    finished: list[str] = field(default_factory=list)
    ahead: bool = False
    grammars: dict[str, RemoteGrammar] = field(default_factory=dict)  # constrained rows' grammars, by seq id


@dataclass(frozen=True)
class Predraft:
    """A proposal drafted ahead, pushed to the engine: `tokens` go on from a history that is, past
    its first `base` tokens (the history of the call after which it was drafted), `suffix`."""

    base: int
    suffix: tuple[int, ...]
    tokens: list[int]

    def after(self, history: Sequence[int]) -> list[int] | None:
        """The tokens that go on from `history`: all of them when it is the assumed history; the
        rest when it goes on from it with their first few (text a grammar forced, which the engine
        appended after the guessed token); None when it does not match."""
        end = self.base + len(self.suffix)
        m = len(history) - end
        if m < 0 or m >= max(len(self.tokens), 1) or tuple(history[self.base : end]) != self.suffix:
            return None
        return self.tokens[m:] if list(history[end:]) == self.tokens[:m] else None


class DraftWorker:
    """The draft model: DraftModelProposer behind a lock (calls may overlap, e.g. a late call
    and the engine's retry). A plain class: a DraftServer replica runs it in a child process
    (`DraftProcess`)."""

    def __init__(self, config: DraftServerConfig) -> None:
        import torch

        from moeserve.engine.draft_model import DraftModelProposer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        from model_shards import load_checkpoint
        from model_shards.device import resolve_device, resolve_dtype

        device = resolve_device(config.device)
        model = load_checkpoint(config.model_path, resolve_dtype(config.dtype, device), device=device)
        self.proposer = DraftModelProposer(model, config.max_num_seqs, config.max_model_len, config.greedy)
        self.grammars = GrammarMirror(config.model_path, model.config.vocab_size, config.grammar)
        self._lock = threading.Lock()
        self._queued = 0  # calls waiting for the lock (engines on other connections)
        self._queue_lock = threading.Lock()
        self._calls = 0
        self._busy_s = 0.0
        self._id = uuid.uuid4().hex[:8]
        self._channel = None
        self._ahead: dict[str, dict[tuple[int, ...], list[int]]] = {}  # seq -> {assumed history: pre-drafted tokens}
        self._hypotheses: dict[str, set[str]] = {}  # seq -> the draft sequence ids of its partial outcomes
        # seq -> {position: (the token drafted there, the draft's second choice, its logit's gap)}
        self._seconds: dict[str, dict[int, tuple[int, int, float]]] = {}
        self.proposer.track_runner_up = config.predraft and config.predraft_partial > 0
        self._predraft_s = 0.0
        self.num_predraft_hits = 0
        self.num_predraft_misses = 0
        self.num_predraft_interrupted = 0
        self.num_predrafts = 0
        self.num_prepares = 0  # `ahead` calls: sequences named before their prefill

    def propose(self, call: DraftCall) -> list[Proposal]:
        """Proposals for `call.requests`, in order: pre-drafted ones where the history is one
        they were drafted for, the rest drafted now (batched)."""
        with self._queue_lock:  # a call waiting for the lock: a round further ahead yields to it
            self._queued += 1
        with self._lock:
            with self._queue_lock:
                self._queued -= 1
            t0 = time.perf_counter()
            for seq_id in call.finished:
                self.proposer.on_finished(seq_id)
                self.grammars.forget(seq_id)
                self._ahead.pop(seq_id, None)
                self._seconds.pop(seq_id, None)
                for hyp in self._hypotheses.pop(seq_id, ()):
                    self.proposer.on_finished(hyp)
            # an ahead call too: its grammars start compiling and its pre-draft drafts under them
            requests = [self._constrained(r, call.grammars.get(r.seq_id)) for r in call.requests]
            if call.ahead:
                self.num_prepares += 1
                return [Proposal([]) for _ in call.requests]
            out: list[Proposal | None] = [None] * len(call.requests)
            for i, r in enumerate(requests):
                ahead = self._ahead.pop(r.seq_id, None)
                if ahead is None:
                    continue
                history = tuple(r.token_ids)
                tokens = _continuing(ahead, history)
                if tokens:  # fewer than asked for when k grew since (adaptive k): still drafts for free
                    out[i] = Proposal(tokens[: r.num_tokens], predrafted=True)
                    self.num_predraft_hits += 1
                    # keep what was drafted further ahead (histories longer than this one)
                    self._ahead[r.seq_id] = {a: t for a, t in ahead.items() if len(a) > len(history)}
                else:
                    self.num_predraft_misses += 1
            todo = [i for i, p in enumerate(out) if p is None]
            if todo:
                for i, p in zip(todo, self.proposer.propose([requests[i] for i in todo])):
                    out[i] = p
                    self._note_seconds(requests[i].seq_id, requests[i].seq_id, len(requests[i].token_ids))
            self._calls += 1
            self._busy_s += time.perf_counter() - t0
            return out

    def _constrained(self, request: ProposalRequest, grammar: RemoteGrammar | None) -> ProposalRequest:
        """The request with this worker's matcher for its grammar, standing at its end (as is)."""
        if grammar is None:
            return request
        matcher = self.grammars.matcher(request.seq_id, grammar, request.token_ids)
        if matcher is None:
            return request
        return replace(request, grammar=matcher, jump_forward=grammar.jump_forward)

    def predraft(self, call: DraftCall, proposals: list[Proposal], peek: Callable[[], Any] | None = None,
                 push: Callable[[Any], None] | None = None) -> None:
        """After answering a call, while the target verifies it (or, for an `ahead` call,
        prefills it): draft each row's next proposal for the likely outcomes of that
        verification, and keep them keyed by the history each assumes. Outcome j < k: drafts
        1..j accepted and the target's correction is the draft's own second choice at position
        j + 1; outcome k: every draft accepted and the bonus token is the draft's own next token
        (one propose of k + 1 tokens: the guess, then the next k; for an `ahead` call, k = 0).
        All outcomes of all rows are one batched propose; each partial outcome drafts under a
        sequence id of its own (`seq#j`), in slots that are free (pre-drafting never evicts).
        The next call answers from the outcome that happened. `peek()` is that call once it has
        arrived: if it brings a history no outcome assumed, pre-drafting stops at the next draft
        step (the engine is not kept waiting for guesses that missed); if every row's history is
        one being drafted, it runs to the end and the call is answered from it.

        `push(payload)` sends what was drafted to the engine at once (the data channel's Push:
        a step that finds its history there needs no call). Then, for the unconstrained rows, one
        round further: the proposal after the guessed one, assuming it is accepted whole too, so
        that it is pushed before the engine's step after next asks (the worker drafts on while
        the target verifies, PEARL's post-verify; when the next message confirms the guess, its
        own first round is drafted already and only the round after it is drafted then)."""
        if not self.config.predraft or not self.proposer.greedy:
            return  # sampled drafts would be drawn ahead of the request's own keyed noise
        with self._lock:
            t0 = time.perf_counter()
            try:
                self._predraft(call, proposals, peek, push or (lambda payload: None))
            finally:
                self._predraft_s += time.perf_counter() - t0

    def _predraft(self, call: DraftCall, proposals: list[Proposal], peek: Callable[[], Any] | None,
                  push: Callable[[Any], None]) -> None:
        free = self.proposer.runner.num_free_slots
        hyps: list[tuple[str, ProposalRequest]] = []  # (the row's seq id, what to draft)
        bases = {r.seq_id: len(r.token_ids) for r in call.requests}
        advanced: list[tuple[Any, int]] = []  # (matcher, tokens): grammars moved to their row's guess
        further: list[ProposalRequest] = []  # unconstrained rows' full-acceptance outcomes
        for r, p in zip(call.requests, proposals):
            if not r.num_tokens or not (p.token_ids or call.ahead):
                continue
            base = list(r.token_ids)
            full = ProposalRequest(r.seq_id, base + p.token_ids, r.num_tokens + 1, r.params)
            if r.seq_id not in call.grammars:
                further.append(full)
                if self._next_of(r.seq_id, full.token_ids) is not None:
                    continue  # drafted (and pushed) a round ahead, after the message before
            matcher = self.grammars.held(r.seq_id) if r.seq_id in call.grammars else None
            if matcher is not None:  # drafted under its grammar too, from the end of the proposal
                n = matcher.accept_tokens(p.token_ids)
                advanced.append((matcher, n))
                if n == len(p.token_ids):
                    full = replace(full, grammar=matcher, jump_forward=call.grammars[r.seq_id].jump_forward)
            hyps.append((r.seq_id, full))
            for j, alt in self._unsure(r.seq_id, base, p.token_ids):
                hyp = f"{r.seq_id}#{j}"
                if hyp not in self._hypotheses.get(r.seq_id, set()):
                    if free <= 0:
                        break
                    free -= 1
                    self._hypotheses.setdefault(r.seq_id, set()).add(hyp)
                hyps.append((r.seq_id, ProposalRequest(hyp, base + p.token_ids[:j] + [alt], r.num_tokens,
                                                       r.params)))
        if hyps:  # none: every row's next proposal was drafted a round ahead already
            try:
                got = self._draft_ahead(hyps, peek)
            finally:
                for matcher, n in advanced:
                    matcher.rollback(n)
            if got is None:  # interrupted: the engine waits for the call that came
                return
            push(self._keep(hyps, got, bases))
        if self.config.predraft_rounds < 2:
            return
        # one round further for the unconstrained rows: after their guessed proposal, accepted whole
        nxt = []
        for full in further:
            guessed = self._next_of(full.seq_id, full.token_ids)
            if guessed is not None and self._next_of(full.seq_id, guessed) is None:
                nxt.append((full.seq_id, replace(full, token_ids=list(guessed))))
        got = self._draft_ahead(nxt, peek, yielding=True)
        if got is not None:
            push(self._keep(nxt, got, bases))

    def _draft_ahead(self, hyps: list[tuple[str, ProposalRequest]], peek: Callable[[], Any] | None,
                     yielding: bool = False) -> list[Proposal] | None:
        """One batched hypothetical propose of the guessed histories; None when there was nothing
        to draft, or when a call arrived that brings one of these sequences with a history none of
        them assumed (then it stops at the next draft step: the engine waits for that call).
        yielding: it also stops for any other message, or any other engine's call waiting for the
        worker (a round further ahead is worth less than handling the next message at once: a
        notice about new sequences, say, whose first proposal the engine needs after its prefill),
        except a notice that confirms it: every row of the engine's next step took the pushed
        proposal this round goes on from (then this round is that step's next proposal, and
        stopping would only draft it again)."""
        from moeserve.engine.draft_model import DraftInterrupted

        if not hyps:
            return None
        self.num_predrafts += 1
        histories: dict[str, list[tuple[int, ...]]] = {}  # seq -> the histories drafted for it here
        for seq, h in hyps:
            histories.setdefault(seq, []).append(tuple(h.token_ids))
        assumed = {(seq, h) for seq, hs in histories.items() for h in hs}

        def confirms(nxt: Any) -> bool:
            """Every row of the engine's next step took the pushed proposal a history here goes on from."""
            return isinstance(nxt, Notice) and not nxt.msg.ahead and all(
                any(h[: len(r.token_ids)] == tuple(r.token_ids) for h in histories.get(r.seq_id, ()))
                for r in nxt.msg.requests)

        def unguessed(nxt: Any) -> bool:
            """A call (not a notice: the engine used a push; nor an ahead call: new sequences) that
            brings a row drafted here with a history none of these assumed."""
            return isinstance(nxt, DraftCall) and not nxt.ahead and any(
                r.seq_id in histories and (r.seq_id, tuple(r.token_ids)) not in assumed
                and (r.seq_id, tuple(r.token_ids[:-1])) not in assumed for r in nxt.requests)

        judged: dict[int, bool] = {}  # id(message) -> whether it stops this round (judged once: a
        # peeked message stays the same object until it is handled, after this round)

        def missed() -> bool:
            if yielding and self._queued:
                return True
            nxt = peek() if peek is not None else None
            if nxt is None:
                return False
            if id(nxt) not in judged:
                judged[id(nxt)] = not confirms(nxt) if yielding else unguessed(nxt)
            return judged[id(nxt)]

        try:
            return self.proposer.propose([h for _, h in hyps], hypothetical=True, interrupted=missed)
        except DraftInterrupted:
            self.num_predraft_interrupted += 1
            return None

    def _keep(self, hyps: list[tuple[str, ProposalRequest]], got: list[Proposal],
              bases: dict[str, int]) -> dict[str, list[Predraft]]:
        """Keeps each pre-draft under the history it assumes; returns them as pushed to the engine."""
        pushed: dict[str, list[Predraft]] = {}
        for (seq, h), p in zip(hyps, got):
            if h.seq_id == seq:  # every draft accepted: the first token is the guessed bonus
                assumed, tokens = tuple(h.token_ids) + tuple(p.token_ids[:1]), p.token_ids[1:]
            else:
                assumed, tokens = tuple(h.token_ids), p.token_ids
            if tokens:
                self._ahead.setdefault(seq, {})[assumed] = tokens
                self._note_seconds(seq, h.seq_id, len(assumed), skip=len(assumed) - len(h.token_ids))
                pushed.setdefault(seq, []).append(Predraft(bases[seq], assumed[bases[seq]:], tokens))
        return pushed

    def _note_seconds(self, seq_id: str, drafted_as: str, start: int, skip: int = 0) -> None:
        """Keeps the second choices of what the draft sequence `drafted_as` just drafted for seq_id,
        its first token at position `start` past `skip` tokens (a guessed bonus token)."""
        if not self.proposer.track_runner_up:
            return
        drafted = self.proposer.runner_up.get(drafted_as, [])[skip:]
        if drafted:
            mine = self._seconds.setdefault(seq_id, {})
            for i, (token, alt, gap) in enumerate(drafted):
                mine[start + i] = token, alt, gap

    def _unsure(self, seq_id: str, base: list[int], tokens: list[int]) -> list[tuple[int, int]]:
        """(j, the draft's second choice there) for the proposal's `predraft_partial` draft tokens
        the draft was least sure of (drafts kept from other histories than this one are only
        guesses, which a miss costs nothing but the rows), in order of j."""
        mine = self._seconds.get(seq_id)
        if not mine or not self.config.predraft_partial:
            return []
        for pos in [pos for pos in mine if pos < len(base)]:
            del mine[pos]
        known = [(got[2], j, got[1]) for j, t in enumerate(tokens)
                 if (got := mine.get(len(base) + j)) and got[0] == t and math.isfinite(got[2])]
        return sorted((j, alt) for _, j, alt in sorted(known)[: self.config.predraft_partial])

    def _next_of(self, seq_id: str, history: list[int] | tuple[int, ...]) -> tuple[int, ...] | None:
        """The history after the proposal pre-drafted for `history` + a guessed bonus token, accepted
        whole (that history + the bonus + the proposal); None when none was drafted."""
        history = tuple(history)
        for assumed, tokens in self._ahead.get(seq_id, {}).items():
            if len(assumed) == len(history) + 1 and assumed[:-1] == history:
                return assumed + tuple(tokens)
        return None

    def channel(self) -> tuple[tuple[str, int], bytes]:
        """The address and secret of this worker's data channel (opened on first ask): engines
        send every step's call there instead of through Ray."""
        with self._lock:
            if self._channel is None:
                from deployments.draft_channel import ChannelServer

                self._channel = ChannelServer(self.propose, self.predraft)
            return self._channel.address, self._channel.authkey

    def stats(self) -> dict[str, Any]:
        """This worker's counters."""
        p = self.proposer
        return {
            "replica": self._id,
            "calls": self._calls,
            "busy_s": self._busy_s,
            "tracked_seqs": p.num_tracked,
            "new_seqs": p.num_new_seqs,
            "rebuilt_tokens": p.num_rebuilt_tokens,
            "evictions": p.num_evictions,
            "predrafts": self.num_predrafts,
            "prepares": self.num_prepares,
            "predraft_hits": self.num_predraft_hits,
            "predraft_misses": self.num_predraft_misses,
            "predraft_interrupted": self.num_predraft_interrupted,
            "predraft_s": self._predraft_s,
            "channel_connections": self._channel.num_connections if self._channel is not None else 0,
            "grammars_compiled": self.grammars.num_compiled,
            "grammars_failed": self.grammars.num_failed,
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    def ping(self) -> bool:
        return True


def _continuing(ahead: dict[tuple[int, ...], list[int]], history: tuple[int, ...]) -> list[int]:
    """Pre-drafted tokens that go on from `history`: those drafted for exactly this history, or,
    when the engine went on from a history drafted for with their first few (plain steps emitting
    the first drafts, or text a grammar forced after the guessed token), the rest of them; []
    when none do."""
    tokens = ahead.get(history)
    if tokens:
        return tokens
    return next((t for assumed, drafted in ahead.items() if (t := Predraft(0, assumed, drafted).after(history))), [])


def main(fd: int) -> None:
    """The child: read the config, load the model, open the data channel, say where it is, then
    answer control requests until the replica goes (its socket closes)."""
    logging.basicConfig(level=logging.INFO, format="draft-worker %(levelname)s %(message)s")
    conn = Connection(fd)
    config = pickle.loads(conn.recv_bytes())
    if config.cpus is not None:
        os.sched_setaffinity(0, config.cpus)
    worker = DraftWorker(config)
    address, authkey = worker.channel()
    conn.send_bytes(pickle.dumps((os.getpid(), address, authkey)))
    while True:
        try:
            op = conn.recv_bytes().decode()
        except (EOFError, OSError):
            os._exit(0)  # the replica is gone: so is this worker (its channel threads included)
        conn.send_bytes(pickle.dumps(worker.stats() if op == "stats" else worker.ping()))


if __name__ == "__main__":
    from deployments import draft_worker  # this module under its own name, so what it pickles unpickles elsewhere

    draft_worker.main(int(sys.argv[1]))
