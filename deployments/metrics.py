"""The gateway's Prometheus metrics, in a registry of its own (one per Gateway instance, so tests and
several gateways in one process stay independent); the engine's gauges are read once per scrape.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; from one decode step up to a whole long request.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        latency = partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = counter("moeserve_requests", "Requests by route and status code", ["route", "code"])
        self.ttft_seconds = latency("moeserve_time_to_first_token_seconds", "Time to first token", ["route"])
        self.e2e_seconds = latency("moeserve_e2e_request_latency_seconds", "End-to-end generation latency", ["route"])
        self.inter_token_seconds = Histogram("moeserve_inter_token_latency_seconds", "Time per output token after "
                                             "the first", buckets=_TOKEN_BUCKETS, registry=r)
        self.generated_tokens = counter("moeserve_generated_tokens", "Output tokens streamed")
        self.prompt_tokens = counter("moeserve_prompt_tokens", "Prompt tokens processed")
        self.retries = counter("moeserve_request_retries", "Streams resumed on a fresh engine attempt after a "
                               "replica or shard failure")
        self.in_flight = gauge("moeserve_requests_in_flight", "Requests streaming now")
        self.grammar_guard_refusals = counter("moeserve_grammar_guard_refusals", "Streams the engine's grammar "
                                              "guard stopped on a token its grammar refuses (must stay 0)")
        self.grammar_refused = counter("moeserve_grammar_refused", "Grammars refused with a 400, by kind", ["kind"])
        self.expert_fraction = gauge("moeserve_expert_routed_fraction", "f_i: share of routes sent to each expert "
                                     "(cumulative, one engine replica)", ["layer", "expert"])
        self.expert_prob = gauge("moeserve_expert_router_probability", "P_i: mean router probability per expert",
                                 ["layer", "expert"])
        self.expert_balance = gauge("moeserve_expert_balance", "Switch balance term N * sum f_i P_i (1 = even)",
                                    ["layer"])
        self.expert_imbalance = gauge("moeserve_expert_imbalance", "max/mean expert load (1 = even)", ["layer"])
        self.expert_overflow = gauge("moeserve_expert_overflow_routes", "Routes dropped or rerouted by expert "
                                     "capacity (cumulative)", ["layer", "kind"])
        self.engine = gauge("moeserve_engine", "Engine replica gauges (one replica, read at scrape)", ["name"])

    def render(self, engine_stats: dict[str, Any] | None = None) -> bytes:
        """Prometheus text format; `engine_stats` (EngineServer.stats()) numbers become gauges."""
        self._render_experts((engine_stats or {}).get("experts") or [])
        for name, value in (engine_stats or {}).items():
            for sub, v in value.items() if isinstance(value, dict) else [(None, value)]:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.engine.labels(name=name if sub is None else f"{name}_{sub}").set(v)
        return generate_latest(self.registry)

    def _render_experts(self, layers: list[dict[str, Any]]) -> None:
        for layer in layers:
            if not layer["tokens"]:
                continue
            name = str(layer["layer"])
            for e, (f, p) in enumerate(zip(layer["f"], layer["P"])):
                self.expert_fraction.labels(layer=name, expert=str(e)).set(f)
                self.expert_prob.labels(layer=name, expert=str(e)).set(p)
            self.expert_balance.labels(layer=name).set(layer["balance"])
            if layer["imbalance"] is not None:
                self.expert_imbalance.labels(layer=name).set(layer["imbalance"])
            for kind in ("dropped", "rerouted"):
                self.expert_overflow.labels(layer=name, kind=kind).set(layer[kind])
