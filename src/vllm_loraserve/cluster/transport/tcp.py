"""TCP adapter transport: one request per connection.

    client: b"GET <name>\\n"
    server: b"OK <nbytes>\\n" + <nbytes of tar>   or   b"ERR <message>\\n"
"""

from __future__ import annotations

import asyncio

from vllm_loraserve.cluster.store import AdapterStore, check_name

MAX_ADAPTER_BYTES = 16 << 30


class TcpTransport:
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._server: asyncio.base_events.Server | None = None

    async def serve(self, store: AdapterStore) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                line = (await reader.readline()).decode().strip()
                verb, _, name = line.partition(" ")
                if verb != "GET":
                    raise ValueError(f"bad request {line[:80]!r}")
                data = await asyncio.to_thread(store.tar, check_name(name))
                writer.write(f"OK {len(data)}\n".encode() + data)
            except (KeyError, ValueError) as e:
                writer.write(f"ERR {e}\n".encode())
            await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(handle, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

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
