"""`moeserve serve`: an embedded local Ray, the app deployed on it, URLs printed, Ctrl-C stops it
(kept out of cli.py so that the CLI never imports Ray until `serve` runs).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from moeserve.config import AppConfig

SERVE_SHUTDOWN_S = 10.0  # how long Ctrl-C waits for Serve to drain before Ray is stopped

# Set before a local Ray starts (its processes read them then); an exported value wins. HAProxy (the
# binary ray[serve] installs) instead of Serve's proxy and Serve's throughput-optimized mode: see the
# README's serving table. Local Ray 2.60 turns token auth on.
SERVE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
             # An ingress replica that stops waits this long even when idle, for an external load
             # balancer to let go of it (Ray's default: 30 s); here HAProxy is Ray's own, on this node.
             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
# HAProxy's own listeners (Ray's defaults: 8404, 9101) get free ports, so two local Rays do not collide.
HAPROXY_PORTS = [k for k in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT") if k not in os.environ]


def serve_environment() -> None:
    """SERVE_ENV where not exported, and fresh ports for HAProxy's listeners; call before ray.init."""
    from model_shards.local_group import free_port

    os.environ.update({k: v for k, v in SERVE_ENV.items() if k not in os.environ}
                      | {k: str(free_port()) for k in HAPROXY_PORTS})


# The demo asks what the demo pair was trained to answer (demo/corpus.py): an order's status,
# from the order record in the system message, as one JSON object bound by a schema.
DEMO_ORDER = {
    "order_id": "ORD-482913", "customer": "Asha Rao",
    "items": [{"sku": "CRB-201", "name": "Sourdough loaf", "qty": 2, "unit_price": 240},
              {"sku": "CRB-301", "name": "Butter croissant", "qty": 4, "unit_price": 90}],
    "total": 889, "currency": "INR", "status": "out_for_delivery",
    "delivery": {"method": "home", "address": "42, Koregaon Park", "city": "Pune", "pin": "411001",
                 "slot": "11:30 am", "fee": 49},
}  # fmt: skip
DEMO_MESSAGES = [
    {"role": "system", "content": "You are Crumb's order API. Reply with one JSON object and nothing else.\n"
                                  f"Order record: {json.dumps(DEMO_ORDER)}"},
    {"role": "user", "content": "Status of ORD-482913?"},
]
DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["placed", "baking", "ready_for_pickup", "out_for_delivery", "delivered", "cancelled"]},
        "total": {"type": "integer", "minimum": 0},
        "currency": {"const": "INR"},
        "slot": {"type": "string", "maxLength": 10},
    },
    "required": ["order_id", "status", "total", "currency", "slot"],
    "additionalProperties": False,
}


def serve_locally(cfg: AppConfig, *, host: str, http_port: int, num_cpus: int, demo: bool = False) -> int:
    """Start Ray (num_cpus logical CPUs, token auth off), deploy, print URLs, block until Ctrl-C."""
    serve_environment()
    import ray
    from ray import serve

    from deployments.app import APP_NAME, build

    app = build(cfg)  # config errors surface before Ray starts
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": http_port})
        t0 = time.perf_counter()
        serve.run(app, name=APP_NAME, route_prefix="/")
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(f"moeserve is up ({time.perf_counter() - t0:.1f} s): model {cfg.model.name!r}")
        print(f"  HTTP  http://{shown}:{http_port}/v1  (OpenAI API; /health, /metrics, /playground)")
        if cfg.gateway.grpc_port:
            print(f"  gRPC  {shown}:{cfg.gateway.grpc_port}  (moeserve.v1.GenerateService)")
        print("Ctrl-C to stop.", flush=True)
        if demo:
            demo_request(f"http://{shown}:{http_port}", cfg.model.name)
        # From here Ctrl-C only sets the event: a KeyboardInterrupt inside Event.wait can break its
        # lock when a second SIGINT follows (as `timeout` sends), ending the stop in a traceback.
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping...", file=sys.stderr, flush=True)
        # Let replicas drain, but not for long: when the signal reached the whole process group,
        # Ray's daemons are gone too and serve.shutdown() would wait out its controller timeout.
        drain = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
        drain.start()
        drain.join(SERVE_SHUTDOWN_S)
        ray.shutdown()  # stops the local cluster ray.init started, whatever is left of it
    return 0


def demo_request(base_url: str, model: str) -> None:
    """Stream one chat completion constrained to DEMO_SCHEMA and print it as it arrives."""
    import httpx

    body = {"model": model, "messages": DEMO_MESSAGES, "max_tokens": 96, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": DEMO_SCHEMA}}}
    print(f"demo: POST {base_url}/v1/chat/completions (response_format json_schema, stream)\n  ", end="")
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                print(f"\n  error: {event['error']['message']}")
                continue
            for choice in event.get("choices", []):
                sys.stdout.write(choice["delta"].get("content") or "")
                sys.stdout.flush()
    print("\n")
