"""A draft deployment's grammars: its worker drafts constrained rows under matchers of its own.

The engine's matchers stay in the engine's process. Each call names a constrained row's grammar
spec and how far the row's output has gone (`RemoteGrammar`), and the worker's `GrammarMirror`
keeps a matcher per sequence standing there: the spec is compiled once per worker, in the
background (a call never waits for a compile: until it is ready the row drafts unconstrained and
the engine cuts what its grammar refuses), the matcher advances by each call's new output tokens,
and it is made afresh when a history does not extend what it accepted. So the draft proposes only
tokens the grammar allows and stops before forced text, as the draft in the engine's process does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moeserve.spec.proposer import ProposalRequest

if TYPE_CHECKING:
    from moeserve.grammar import GrammarConfig, GrammarSpec

log = logging.getLogger(__name__)

MAX_GRAMMARS = 64  # compiled grammars a worker keeps (least recently used out)


@dataclass(frozen=True)
class RemoteGrammar:
    """A constrained row's grammar, as a call carries it: its spec, how many of the
    row's last tokens are output its grammar accepted, and whether a proposal drafts through text
    the grammar forces (the engine's jump-forward)."""

    spec: GrammarSpec
    num_accepted: int
    jump_forward: bool = False

    @classmethod
    def of(cls, request: ProposalRequest) -> RemoteGrammar | None:
        """For a request whose grammar is a GrammarMatcher (the engine's); None otherwise."""
        compiled = getattr(request.grammar, "compiled", None)
        if compiled is None:
            return None
        return cls(compiled.spec, request.grammar.num_accepted, request.jump_forward)


class GrammarMirror:
    """Per sequence, a matcher at the end of its history (see the module docstring).

    tokenizer_path: the draft's checkpoint folder (its tokenizer is the target's);
    vocab_size: the draft's vocabulary (its logits' width); config: the engine's GrammarConfig, so
    the draft's masks are the target's.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, config: GrammarConfig | None = None) -> None:
        self._args = (tokenizer_path, vocab_size, config)
        self._compiler: Any = None  # built with the first grammar
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft-grammar")
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # spec key -> CompiledGrammar, or None: it failed
        self._pending: dict[str, Future] = {}
        self._held: dict[str, tuple[str, Any, list[int]]] = {}  # seq id -> (spec key, matcher, tokens accepted)
        self.num_compiled = 0
        self.num_failed = 0

    def matcher(self, seq_id: str, grammar: RemoteGrammar, token_ids: Sequence[int]) -> Any | None:
        """The sequence's matcher standing after `token_ids`; None while its grammar compiles, when it
        failed to compile, or when it refuses output the engine's grammar accepted."""
        compiled = self._compiled_for(grammar.spec)
        if compiled is None:
            self._held.pop(seq_id, None)  # nothing stale stands in for it
            return None
        output = list(token_ids[len(token_ids) - grammar.num_accepted:]) if grammar.num_accepted else []
        held = self._held.get(seq_id)
        if held is None or held[0] != grammar.spec.key or output[: len(held[2])] != held[2]:
            from moeserve.grammar.matcher import GrammarMatcher

            held = self._held[seq_id] = (grammar.spec.key, GrammarMatcher(compiled), [])
        _, matcher, accepted = held
        new = output[len(accepted):]
        n = matcher.accept_tokens(new)
        accepted.extend(new[:n])
        if n < len(new):
            del self._held[seq_id]
            return None
        return matcher

    def held(self, seq_id: str) -> Any | None:
        """The sequence's matcher as the last `matcher` call left it (None: unconstrained there)."""
        held = self._held.get(seq_id)
        return None if held is None else held[1]

    def forget(self, seq_id: str) -> None:
        self._held.pop(seq_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _compiled_for(self, spec: Any) -> Any | None:
        key = spec.key
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        job = self._pending.get(key)
        if job is None:
            self._pending[key] = self._pool.submit(self._compile, spec)
            return None
        if not job.done():
            return None
        del self._pending[key]
        try:
            compiled = job.result()
            self.num_compiled += 1
        except Exception as e:  # an invalid or unsupported grammar, or no tokenizer: this row drafts unconstrained
            log.warning("draft worker: grammar not compiled (%s: %s); its rows draft unconstrained", type(e).__name__, e)
            compiled = None
            self.num_failed += 1
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: Any) -> Any:
        if self._compiler is None:
            from moeserve.grammar import GrammarCompiler
            from moeserve.tokenizer import load_tokenizer

            path, vocab_size, config = self._args
            self._compiler = GrammarCompiler(load_tokenizer(path), vocab_size, config=config)
        return self._compiler.compile(spec)
