"""A TCP proxy on loopback that tests can cut and restore: a dependency "outage"
(PostgreSQL, Redis, a provider) without stopping the shared server other tests use.

    proxy = await TcpProxy.start("127.0.0.1", 5432)
    dsn = ...port=proxy.port...
    await proxy.cut()      # drop every connection and refuse new ones
    await proxy.restore()  # accept again
    proxy.pause()          # hold the server's replies in the proxy (a slow server)
    proxy.resume()         # deliver them
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        #: Bytes from the server held back by pause() so far.
        self.held_bytes = 0

    @classmethod
    async def start(cls, target_host: str, target_port: int, port: int = 0) -> TcpProxy:
        proxy = cls(target_host, target_port)
        await proxy._listen(port)
        return proxy

    async def _listen(self, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer)),
            asyncio.ensure_future(self._pipe(up_reader, writer, self)),
        ]
        self._pipes.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
                self._pipes.discard(t)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, holder: TcpProxy | None = None
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if holder is not None and not holder._flowing.is_set():
                    holder.held_bytes += len(data)
                    await holder._flowing.wait()
                writer.write(data)
                await writer.drain()

    async def cut(self) -> None:
        """Stop listening and abort every open connection (like a dead server)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            transport = w.transport
            transport.abort()
        for t in list(self._pipes):
            t.cancel()
        await asyncio.sleep(0)

    async def restore(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            await self._listen(self.port)

    def pause(self) -> None:
        """Hold every reply from the server inside the proxy (requests still go through)."""
        self._flowing.clear()

    def resume(self) -> None:
        """Deliver the held replies and stop holding."""
        self._flowing.set()

    async def close(self) -> None:
        await self.cut()
