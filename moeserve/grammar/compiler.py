"""Per-model grammar compilation: `GrammarCompiler` turns a `GrammarSpec` into a `CompiledGrammar`.

One compiler per (tokenizer, model vocab size), shared by a process's requests. Two backends,
chosen per request: xgrammar for what it enforces, and llguidance for schemas that rewriting
refuses for a feature llguidance enforces exactly (LLGUIDANCE_FEATURES). xgrammar's C++ compile
cannot be interrupted, so it runs in a small thread pool and the caller stops waiting at the
limit (GrammarTimeoutError); the job finishes into the cache, and a repeat request waits on it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from moeserve.grammar.errors import GrammarError, GrammarTimeoutError
from moeserve.grammar.regex_compat import xgrammar_regex
from moeserve.grammar.schema_support import LLGUIDANCE_FEATURES, for_llguidance, prepare_json_schema
from moeserve.grammar.spec import GrammarSpec
from moeserve.grammar.tokenizer_info import build_tokenizer_info
from moeserve.grammar.utf8 import second_byte_rows


@dataclass(frozen=True)
class GrammarConfig:
    """Limits and output style of grammar compilation. The configurable ones come from the config
    tree (moeserve/config.py's GrammarSection.grammar_config(), where their defaults are)."""

    compile_timeout_s: float
    max_spec_chars: int
    # (", ", ": ") spaced JSON, (",", ":") compact: no whitespace at all between tokens. A weak model
    # given `any_whitespace` spends tokens on spaces and newlines (a random model almost never stops).
    separators: tuple[str, str]
    one_of: str  # "exact" or "as_any_of" (GrammarSection.one_of)
    max_threads: int = 2  # xgrammar threads per compile
    max_compiles_in_flight: int = 2  # compile jobs running at once (a runaway one holds a slot)
    cache_size: int = 256  # compiled grammars (and compile errors) kept, least recently used out
    # A schema with ~80 optional properties compiles to ~25 MB (JSONSchemaBench sp_0), so bound bytes too.
    cache_max_bytes: int = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_threads", "max_compiles_in_flight", "cache_size", "cache_max_bytes", "max_spec_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"GrammarConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"GrammarConfig.compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if len(self.separators) != 2 or any(s.strip() not in (",", ":") for s in self.separators):
            raise ValueError(f"GrammarConfig.separators must look like (',', ':'), got {self.separators!r}")


@dataclass(frozen=True, eq=False)
class VocabRows:
    """Per-vocabulary data every matcher needs besides the grammar."""

    decoded_vocab: list[bytes]  # token id -> bytes ("" for tokens never allowed)
    stop_row: torch.Tensor  # [W] bitmask row allowing only the stop tokens
    second_byte_rows: dict[int, torch.Tensor]  # UTF-8 lead -> [W] tokens that may follow it (utf8.py)


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for matching, bound to one compiler's vocabulary. Immutable and shared by
    every request with the same spec; per-request state lives in `GrammarMatcher`."""

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar | None = field(repr=False, compare=False)  # None: llguidance's
    source: str = field(repr=False)  # what the backend compiled: rewritten schema, regex, EBNF, llguidance grammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    compile_s: float = field(compare=False)
    vocab: VocabRows = field(repr=False, compare=False)
    llg_tokenizer: llguidance.LLTokenizer | None = field(default=None, repr=False, compare=False)

    @property
    def backend(self) -> str:
        return "xgrammar" if self.grammar is not None else "llguidance"

    @property
    def memory_size_bytes(self) -> int:
        return self.grammar.memory_size_bytes if self.grammar is not None else len(self.source)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and model vocabulary. `vocab_size` is the
    model's (lm_head rows; ids past the tokenizer are never allowed); stop tokens default to EOS."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None, *, config: GrammarConfig,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        self.config = config
        if vocab_size is not None and vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
        infos = {kind: build_tokenizer_info(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                            forbid_control_bytes=kind == "json") for kind in ("text", "json")}
        text_info = infos["text"]
        self.vocab_size: int = text_info.vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(text_info.stop_token_ids)
        self.tokenizer = tokenizer
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built on the first llguidance grammar
        self.decoded_vocab: list[bytes] = text_info.decoded_vocab
        threads = self.config.max_threads
        self._xgr = {kind: xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False) for kind, info in infos.items()}
        self._pool = ThreadPoolExecutor(self.config.max_compiles_in_flight, thread_name_prefix="grammar-compile")
        self._lock = threading.RLock()  # a job done before add_done_callback runs _finish in this thread
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._in_flight: dict[str, Future] = {}
        self._cache_bytes = 0
        self.hits = 0
        self.misses = 0
        stop_row = xgr.allocate_token_bitmask(1, self.vocab_size)[0].zero_()  # [W]
        for t in self.stop_token_ids:
            stop_row[t // 32] |= 1 << (t % 32)
        self._vocab = VocabRows(self.decoded_vocab, stop_row, second_byte_rows(self.decoded_vocab, self.vocab_size))

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache when possible. Raises GrammarError naming
        the problem (invalid, unsupported, too large), or GrammarTimeoutError past the time limit."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile() takes a GrammarSpec, got {type(spec).__name__}")
        size = len(spec.value or "")
        if size > self.config.max_spec_chars:
            raise GrammarError(f"{spec.kind} is {size} characters; the limit is {self.config.max_spec_chars}", feature="size")
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                if isinstance(cached, GrammarError):
                    raise type(cached)(cached.message, feature=cached.feature)
                return cached
            job = self._in_flight.get(spec.key)
            if job is None:
                self.misses += 1
                job = self._pool.submit(self._compile_now, spec)
                self._in_flight[spec.key] = job
                job.add_done_callback(lambda done, key=spec.key: self._finish(key, done))
        try:
            return job.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            limit = self.config.compile_timeout_s
            raise GrammarTimeoutError(f"compiling the {spec.kind} grammar took longer than {limit:g} s", feature="timeout") from None

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache), "bytes": self._cache_bytes,
                    "in_flight": len(self._in_flight)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -----------------------------------------------------------------------

    def _finish(self, key: str, job: Future) -> None:
        error = job.exception()
        with self._lock:
            self._in_flight.pop(key, None)
            if error is None or isinstance(error, GrammarError):  # deterministic outcomes only
                entry = job.result() if error is None else error
                self._cache[key] = entry
                self._cache_bytes += _entry_bytes(entry)
                cfg = self.config
                while len(self._cache) > 1 and (len(self._cache) > cfg.cache_size or self._cache_bytes > cfg.cache_max_bytes):
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= _entry_bytes(old)

    def _compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        json_opts = {"any_whitespace": False, "separators": self.config.separators}
        try:
            if spec.kind == "json_object":
                source = '{"type":"object"}'
                # strict_mode=False: "any object" must allow any keys (strict allows none undeclared).
                grammar = self._xgr["json"].compile_json_schema(source, strict_mode=False, **json_opts)
            elif spec.kind == "json_schema":
                schema = json.loads(spec.value)
                try:
                    prepared = prepare_json_schema(schema, one_of=self.config.one_of)
                except GrammarError as refused:  # what xgrammar cannot enforce: llguidance may
                    return self._compile_llguidance(spec, schema, refused, start)
                source = json.dumps(prepared, ensure_ascii=False)
                grammar = self._xgr["json"].compile_json_schema(source, strict_mode=True, **json_opts)
            elif spec.kind == "regex":
                source = xgrammar_regex(spec.value, dot_excludes_newline=True)  # Python's semantics: regex_compat.py
                grammar = self._xgr["text"].compile_regex(source)
            elif spec.kind == "ebnf":
                source = spec.value
                grammar = self._xgr["text"].compile_grammar(source)
            else:
                source = "root ::= " + " | ".join(ebnf_literal(c) for c in spec.choices)
                grammar = self._xgr["text"].compile_grammar(source)
        except GrammarError as e:
            if spec.kind == "regex":
                raise GrammarError(f"invalid regex: {e.message}", feature="invalid-regex") from None
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse/convert errors
            raise GrammarError(f"invalid {spec.kind}: {_xgr_message(e)}", feature=f"invalid-{spec.kind}") from None
        return self._wrap(spec, grammar, source=source, start=start)

    def _compile_llguidance(self, spec: GrammarSpec, schema: object, refused: GrammarError,
                            start: float) -> CompiledGrammar:
        """llguidance's JSON-schema grammar for a schema the xgrammar path refused: as written, else
        narrowed as for xgrammar (keywords llguidance lacks rewritten away); the refusal stands
        (with llguidance's reason added) when llguidance takes neither."""
        if refused.feature not in LLGUIDANCE_FEATURES:
            raise refused
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids))
        item, key = self.config.separators
        options = {"whitespace_flexible": False, "item_separator": item, "key_separator": key}
        why = "not a JSON schema it reads"
        for attempt in (lambda: schema, lambda: for_llguidance(schema, self.config.one_of)):
            try:
                source = llguidance.LLMatcher.grammar_from_json_schema(attempt(), defaults=options)
            except (ValueError, GrammarError) as e:
                why = str(e)
                continue
            probe = llguidance.LLMatcher(self._llg_tokenizer, source, log_level=0)
            if not probe.is_error():
                return self._wrap(spec, None, source=source, start=start, llg_tokenizer=self._llg_tokenizer)
            why = probe.get_error()
        raise GrammarError(f"{refused.message} (llguidance: {why})", feature=refused.feature) from None

    def _wrap(self, spec: GrammarSpec, grammar: xgr.CompiledGrammar | None, *, source: str, start: float,
              llg_tokenizer: llguidance.LLTokenizer | None = None) -> CompiledGrammar:
        return CompiledGrammar(spec, grammar, source, self.vocab_size, self.stop_token_ids,
                               time.perf_counter() - start, self._vocab, llg_tokenizer)


def _entry_bytes(entry: CompiledGrammar | GrammarError) -> int:
    return entry.memory_size_bytes if isinstance(entry, CompiledGrammar) else len(entry.message)


def ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal (its `\\xHH` reads more than two hex digits: use \\u)."""
    body = "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c for c in text)
    return f'"{body}"'


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _xgr_message(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:45:16] /project/cpp/x.cc:5082: ")."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__
