"""Grammar-constrained decoding over xgrammar: JSON schema, regex, EBNF and choice.

Per model (one per process, shared): `GrammarCompiler` -> `CompiledGrammar` (cached).
Per request: `GrammarSpec` (what the client asked; small, picklable) and `GrammarMatcher`
(where the output stands; fills bitmask rows, accepts and rolls back tokens).
"""

from moeserve.grammar.bitmask import allocate_bitmask, apply_bitmask, apply_bitmask_torch, reset_bitmask
from moeserve.grammar.compiler import CompiledGrammar, GrammarCompiler, GrammarConfig
from moeserve.grammar.errors import GrammarError, GrammarTimeoutError
from moeserve.grammar.matcher import GrammarMatcher
from moeserve.grammar.spec import GRAMMAR_KINDS, GrammarKind, GrammarSpec
from moeserve.grammar.termination import ClosingPolicy, bias_toward_closing

__all__ = ["GRAMMAR_KINDS", "ClosingPolicy", "CompiledGrammar", "GrammarCompiler", "GrammarConfig", "GrammarError",
           "GrammarKind", "GrammarMatcher", "GrammarSpec", "GrammarTimeoutError", "allocate_bitmask", "apply_bitmask",
           "apply_bitmask_torch", "bias_toward_closing", "reset_bitmask"]
