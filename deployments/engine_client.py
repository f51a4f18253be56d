"""The engine deployment seen through a Serve handle, as the gateway's EngineClient.

One streaming handle call per request (a Serve call costs more than a decode step): the chunks
then flow over that call.
Leaving the stream early (client gone, guard refusal) cancels the call, and Serve's
cancellation closes the EngineServer.generate generator in the engine replica, which
aborts the request there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from moeserve.protocol import GenerateChunk, GenerateRequest


class ServeEngineClient:
    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._stream = handle.options(stream=True)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        response = self._stream.generate.remote(request)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                response.cancel()

    async def health(self) -> dict[str, Any]:
        return await self._handle.health.remote()

    async def stats(self) -> dict[str, Any]:
        return await self._handle.stats.remote()


def as_engine_client(engine: Any) -> Any:
    """Wrap a Serve handle; anything else (an EngineServer in tests) is used as it is."""
    return ServeEngineClient(engine) if isinstance(engine, DeploymentHandle) else engine
