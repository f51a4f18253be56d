"""Failure isolation: after a step fails, find the request that breaks it; its neighbours carry on.

A step that fails before it emitted anything (LLMEngine.step raises StepError) is retried
without blaming anyone yet: its requests go back to the queue (output kept, cache
recomputed) and run one at a time, each for ISOLATION_STEPS steps alone (the scheduler's
`focus`). A request that fails alone is given one more try alone (the fault may have been
a dying shard, not the request); failing alone twice, it is the cause and ends with a
non-retryable INTERNAL error. The others never see the failure, and each request's
retries are its own. Batching resumes when every suspect has been cleared.
"""

from __future__ import annotations

from collections import Counter

from moeserve.engine.engine import LLMEngine
from moeserve.protocol import ErrorCode, GenerateChunk, Usage, error_chunk

ISOLATION_STEPS = 2  # steps a suspect runs alone (its prefill and a decode) to be cleared
ALONE_FAILURES = 2  # failures alone that make a request the cause


class Isolation:
    def __init__(self, engine: LLMEngine, counters: Counter[str]) -> None:
        self.engine, self.counters = engine, counters
        self.suspects: list[str] = []  # requests of failed steps, waiting to run alone
        self._alone_failures: Counter[str] = Counter()
        self._focus_steps = 0

    def failed(self, request_ids: list[str], cause: BaseException | None) -> list[GenerateChunk]:
        """A step with `request_ids` failed before emitting: requeue, then try them one by one.
        Returns the error chunk of a request found to be the cause, if any."""
        focus = self.engine.scheduler.focus
        if focus is None or focus.seq_id not in request_ids:
            self.engine.requeue(request_ids)
            self.suspects += [rid for rid in request_ids if rid not in self.suspects]
            self._next()
            return []
        self._alone_failures[focus.seq_id] += 1
        if self._alone_failures[focus.seq_id] < ALONE_FAILURES:  # once more, in case the fault was not its own
            self.engine.requeue([focus.seq_id])
            self._focus_steps = 0
            return []
        self.counters["isolated_failures"] += 1
        chunk = error_chunk(focus.seq_id, ErrorCode.INTERNAL,
                            f"engine step failed with this request alone: {type(cause).__name__}: {cause}",
                            Usage(len(focus.prompt_ids), len(focus.output_ids)), retryable=False)
        self.engine.abort(focus.seq_id)
        self._next()
        return [chunk]

    def stepped(self) -> None:
        """A step succeeded: the request in focus is cleared after ISOLATION_STEPS of them."""
        sched = self.engine.scheduler
        if sched.focus is None and not self.suspects:
            return
        self._focus_steps += 1
        if sched.focus is None or self._focus_steps >= ISOLATION_STEPS:  # cleared (or finished)
            sched.focus = None
            self._next()

    def _next(self) -> None:
        """Focus the scheduler on the next suspect still alive (none left: back to batching)."""
        sched, live = self.engine.scheduler, self.engine.requests
        self.suspects = [rid for rid in self.suspects if rid in live]
        for rid in [r for r in self._alone_failures if r not in live]:
            del self._alone_failures[rid]
        if sched.focus is not None and sched.focus.seq_id in self.suspects:
            self.suspects.remove(sched.focus.seq_id)
        sched.focus = live[self.suspects.pop(0)] if self.suspects else None
        self._focus_steps = 0
