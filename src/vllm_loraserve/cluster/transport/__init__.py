"""Moving adapters between engines (LoRAServe §IV-B's distributed pool).

A transport serves an engine's store to its peers and fetches an adapter
from a peer into a store. Implementations are chosen by name:

- `tcp` (this package): an uncompressed tar of the adapter directory over a
  TCP connection on loopback (or the engines' network);
- `rdma`: GPUDirect RDMA through pyverbs is planned; it is not implemented,
  and asking for it fails with that message rather than falling back.
"""

from __future__ import annotations

from typing import Protocol

from vllm_loraserve.cluster.store import AdapterStore


class Transport(Protocol):
    name: str

    async def serve(self, store: AdapterStore) -> str:
        """Start serving `store`; returns the address peers fetch from."""
        ...

    async def fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        """Copy `adapter` from the peer at `address` into `store`; bytes moved."""
        ...

    async def close(self) -> None: ...


def make_transport(name: str, host: str = "127.0.0.1") -> Transport:
    if name == "tcp":
        from vllm_loraserve.cluster.transport.tcp import TcpTransport

        return TcpTransport(host)
    if name == "rdma":
        raise NotImplementedError(
            "the RDMA (pyverbs) adapter transport is not implemented in this version; "
            "use --transport tcp")
    raise ValueError(f"unknown transport {name!r}; available: tcp")
