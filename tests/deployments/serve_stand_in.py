"""An in-process stand-in for Serve's streaming handle to the engine replica, for the direct token
path (`gateway.direct_tokens`): `handle(server).generate_direct.remote(...)` iterates the replica's
`generate_direct`, and `cancel()` closes it, as Serve's cancellation does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


class Call:
    """A streaming Serve call's response: iterate it; `cancel()` closes the replica's generator."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.agen)

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


def handle(server):
    return SimpleNamespace(generate_direct=SimpleNamespace(remote=lambda *args: Call(server.generate_direct(*args))))
