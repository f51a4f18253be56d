"""A local Ray for a test module, and one Serve app on it: free loopback ports, wait for
/health, shut everything down after.

A port found free can be taken by another process before Serve binds it (the proxy, or the
gateway's gRPC server, then fails to start); the whole start is retried on fresh ports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from deployments.local import serve_environment
from model_shards.local_group import free_port
from moeserve.config import AppConfig


def wait_healthy(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout:.0f} s")


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """Ray on this machine for one test module (4 logical CPUs, no token auth); Serve, if
    something started it, and Ray are shut down after."""
    serve_environment()
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def serve_app(build: Callable[[int], tuple], *, proxy_location: str | None = None,
              attempts: int = 3) -> Iterator[dict[str, str]]:
    """`build(grpc_port)` returns (app, name, route_prefix). Yields {"http": base URL, "grpc": host:port}."""
    with local_ray(), serve_on_ray(build, proxy_location=proxy_location, attempts=attempts) as urls:
        yield urls


@contextlib.contextmanager
def serve_on_ray(build: Callable[[int], tuple], *, proxy_location: str | None = None, attempts: int = 3,
                 healthy_s: float = 60) -> Iterator[dict[str, str]]:
    """`serve_app` on the Ray this process is already connected to (a local one, a cluster);
    Serve is shut down after, Ray is left running."""
    from ray import serve

    for attempt in range(attempts):
        http_port, grpc_port = free_port(), free_port()
        try:
            options = {"proxy_location": proxy_location} if proxy_location else {}
            serve.start(http_options={"host": "127.0.0.1", "port": http_port}, **options)
            app, name, route_prefix = build(grpc_port)
            serve.run(app, name=name, route_prefix=route_prefix)
            base = f"http://127.0.0.1:{http_port}"
            wait_healthy(base, healthy_s)
            break
        except Exception:
            serve.shutdown()
            if attempt == attempts - 1:
                raise
    try:
        yield {"http": base, "grpc": f"127.0.0.1:{grpc_port}"}
    finally:
        serve.shutdown()


@contextlib.contextmanager
def gateway_in_thread(engine: Any, model_name: str, model_path: str, max_model_len: int) -> Iterator[str]:
    """The gateway and an engine in this process, no Ray: the gateway's HTTP app on a free local port (uvicorn on a thread) over `engine` (an LLMEngine,
    run by an in-process EngineServer); yields its base URL, stops both on exit."""
    import uvicorn

    from deployments.engine_server import EngineServer
    from deployments.gateway import Gateway

    tree = AppConfig.from_dict({"model": {"name": model_name, "path": model_path},
                                "engine": {"max_model_len": max_model_len}, "gateway": {"grpc_port": None}})
    server = EngineServer(tree, engine=engine)
    gateway = Gateway(server, tree)
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(gateway.http_app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(10)
        server.shutdown()
