"""Grammar-constrained decoding over xgrammar: JSON schema, regex, EBNF and choice.

Per model (one per process, shared): `GrammarCompiler` -> `CompiledGrammar` (cached).
Per request: `GrammarSpec` (what the client asked; small, picklable) and `GrammarMatcher`
(where the output stands; fills bitmask rows, accepts and rolls back tokens).

    spec = GrammarSpec.from_request(response_format=body.get("response_format"), ...)  # GrammarError -> 400
    compiled = compiler.compile(spec)                                                # GrammarError -> 400
    matcher = GrammarMatcher(compiled)
    bitmask = allocate_bitmask(batch, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, row); apply_bitmask(logits, bitmask)
"""

from moeserve.grammar.bitmask import allocate_bitmask, apply_bitmask, apply_bitmask_torch, reset_bitmask
from moeserve.grammar.compiler import CompiledGrammar, GrammarCompiler, GrammarConfig
from moeserve.grammar.errors import GrammarError, GrammarTimeoutError
from moeserve.grammar.matcher import GrammarMatcher
from moeserve.grammar.oracle import check_output
from moeserve.grammar.spec import GRAMMAR_KINDS, GrammarKind, GrammarSpec
from moeserve.grammar.termination import ClosingPolicy, bias_toward_closing

__all__ = ["GRAMMAR_KINDS", "ClosingPolicy", "CompiledGrammar", "GrammarCompiler", "GrammarConfig", "GrammarError",
           "GrammarKind", "GrammarMatcher", "GrammarSpec", "GrammarTimeoutError", "allocate_bitmask", "apply_bitmask",
           "apply_bitmask_torch", "bias_toward_closing", "check_output", "reset_bitmask"]
