"""The per-token trace (SamplingParams.trace_experts / trace_speculation): what the engine reports
about how each new token came to be. Routing is recorded by the model (CausalLM.record_routing)
and split per row by the runner; this turns one row's step into TokenTrace entries."""

from __future__ import annotations

from moeserve.sampling_params import SamplingParams, TokenTrace


def token_traces(params: SamplingParams, tokens: list[int], first: int, accepted: int | None,
                 routes: list[tuple] | None, forced: tuple[int, ...] = ()) -> list[TokenTrace]:
    """Entries for one row's new tokens: tokens[j] was chosen at fed position first + j
    (negative: from the end) of the row's routes [(layer, ids [T, K], weights [T, K])]; the first
    `accepted` of them are accepted drafts (None: no drafts this step), except those at `forced`
    positions: text the grammar forced inside the proposal."""
    entries = []
    for j, t in enumerate(tokens):
        source = None
        if params.trace_speculation:
            source = "forced" if j in forced else "draft" if accepted is not None and j < accepted else "target"
        experts = None
        if params.trace_experts and routes is not None:
            at = first + j
            experts = tuple((layer, tuple(ids[at].tolist()), tuple(round(w, 4) for w in weights[at].tolist()))
                            for layer, ids, weights in routes)
        entries.append(TokenTrace(t, source, experts))
    return entries


def forced_traces(params: SamplingParams, tokens: list[int]) -> list[TokenTrace]:
    """Entries for tokens the grammar forced (jump-forward): no pass chose them, so no routing."""
    return [TokenTrace(t, "forced" if params.trace_speculation else None) for t in tokens]
