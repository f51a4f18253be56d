"""moeserve.protocol.paced: how a stream's chunks become messages."""

import asyncio
import time

from moeserve.protocol import GenerateChunk, Usage, paced


def chunk(tokens: tuple[int, ...], done: int, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk("r", tokens, "".join(map(str, tokens)), finish, Usage(prompt_tokens=1, completion_tokens=done))


def run(first: GenerateChunk, later: list[tuple[float, GenerateChunk]], interval: float, is_first: bool = False):
    """paced(first, queue, ...) while `later` chunks arrive at their delays: (message, seconds it took)."""

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for delay, c in later:
            loop.call_later(delay, queue.put_nowait, c)
        t0 = time.perf_counter()
        message = await paced(first, queue, interval, is_first)
        return message, time.perf_counter() - t0, queue.qsize()

    return asyncio.run(main())


def test_the_last_chunk_ends_the_wait():
    """A stream that finishes during the pacing wait is sent at once, everything coalesced, rather than
    at the end of the interval (a request's last tokens would wait for nothing)."""
    message, took, left = run(chunk((2,), 2), [(0.02, chunk((3,), 3)), (0.05, chunk((4,), 4, "stop"))], interval=2.0)
    assert message.token_ids == (2, 3, 4) and message.text == "234" and message.finish_reason == "stop"
    assert message.usage.completion_tokens == 4 and left == 0
    assert took < 1.0


def test_an_unfinished_stream_waits_the_interval_and_coalesces():
    message, took, left = run(chunk((2,), 2), [(0.02, chunk((3,), 3)), (0.6, chunk((4,), 4))], interval=0.2)
    assert message.token_ids == (2, 3) and not message.finished and left == 0
    assert 0.15 < took < 0.55
    message, took, left = run(chunk((2,), 2), [], interval=0.0)  # no pacing: at once
    assert message.token_ids == (2,) and took < 0.1


def test_the_first_message_goes_out_alone_and_at_once():
    message, took, left = run(chunk((1, 2), 2), [(0.0, chunk((3,), 3))], interval=2.0, is_first=True)
    assert message.token_ids == (1, 2) and took < 0.5
