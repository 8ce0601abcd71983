"""Helpers for the connection tests: a TCP proxy that can play a vanished client, and engine steps
held or slowed so that a stream outlives what a test waits for."""

from __future__ import annotations

import asyncio
import threading
import time

HELD_STEP_TIMEOUT_S = 60  # a held step goes on after this, should a test never release it


class FreezingProxy:
    """Relays TCP between clients and `upstream` (host:port) until frozen; then relays nothing, in
    either direction, with every socket kept open: to the server, its client is gone without a FIN."""

    def __init__(self, upstream: str):
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.frozen = False
        self.closed = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> FreezingProxy:
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def freeze(self) -> None:
        self.frozen = True

    async def close(self) -> None:
        self.closed.set()
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _connect(self, client_reader, client_writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        self.writers += [client_writer, upstream_writer]
        await asyncio.gather(self._relay(client_reader, upstream_writer), self._relay(upstream_reader, client_writer))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (data := await reader.read(1 << 16)) and not self.frozen:
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            return
        if self.frozen:
            await self.closed.wait()  # the sockets stay open, unread and unwritten
        else:
            writer.close()  # the peer closed: so does the other side


class HeldSteps:
    """LLMEngine.step held: `step` runs the first `free` steps, then waits before each until `release()`."""

    def __init__(self, step, free: int = 1):
        self.free = free
        self.released = threading.Event()

        def held_step(engine, *args, **kwargs):
            if self.free:
                self.free -= 1
            else:
                self.released.wait(HELD_STEP_TIMEOUT_S)
            return step(engine, *args, **kwargs)

        self.step = held_step

    def release(self) -> None:
        self.released.set()


def slowed(step, delay_s: float):
    """LLMEngine.step, each taking `delay_s` longer: a stream of n tokens lasts at least n * delay_s."""
    def slow_step(engine, *args, **kwargs):
        time.sleep(delay_s)
        return step(engine, *args, **kwargs)

    return slow_step
