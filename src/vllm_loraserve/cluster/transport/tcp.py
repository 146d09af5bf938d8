"""TCP adapter transport: one request per connection.

    client: b"GET <name>\\n"
    server: b"OK <nbytes>\\n" + <nbytes of tar>   or   b"ERR <message>\\n"

The nixl transport (nixl.py) serves the same port with one more verb, so a
tcp engine and a nixl engine fetch from each other.
"""

from __future__ import annotations

import asyncio

from vllm_loraserve.cluster.store import AdapterStore, check_name

MAX_ADAPTER_BYTES = 16 << 30
BAD_REQUEST = "bad request"  # the start of the error for a verb the server does not know


class TcpTransport:
    name = "tcp"
    last_via = "tcp"  # the path the latest fetch took (nixl.py may fall back to this one)

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._server: asyncio.base_events.Server | None = None

    async def serve(self, store: AdapterStore) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                line = (await reader.readline()).decode().strip()
                verb, _, name = line.partition(" ")
                await self.answer(verb, check_name(name) if name else name, store, reader,
                                  writer)
            except (KeyError, ValueError) as e:
                writer.write(f"ERR {e}\n".encode())
            await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(handle, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

    async def answer(self, verb: str, name: str, store: AdapterStore,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request; a subclass adds verbs (nixl.py). A verb this server
        does not know is answered `ERR bad request ...` (BAD_REQUEST)."""
        if verb != "GET":
            raise ValueError(f"{BAD_REQUEST} {verb[:20]!r}")
        data = await asyncio.to_thread(store.tar, name)
        writer.write(f"OK {len(data)}\n".encode() + data)

    async def fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET {check_name(adapter)}\n".encode())
            await writer.drain()
            head = (await reader.readline()).decode().strip()
            status, _, rest = head.partition(" ")
            if status != "OK":
                raise RuntimeError(f"peer {address} could not send {adapter!r}: {rest}")
            n = int(rest)
            if not 0 < n <= MAX_ADAPTER_BYTES:
                raise RuntimeError(f"peer {address} announced {n} bytes for {adapter!r}")
            data = await reader.readexactly(n)
        finally:
            writer.close()
        await asyncio.to_thread(store.put_tar, adapter, data)
        return n

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
