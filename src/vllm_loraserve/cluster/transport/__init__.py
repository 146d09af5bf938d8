"""Moving adapters between engines (LoRAServe §IV-B's distributed pool).

A transport serves an engine's store to its peers and fetches an adapter
from a peer into a store. Implementations are chosen by name:

- `tcp` (tcp.py): an uncompressed tar of the adapter directory over a
  TCP connection on loopback (or the engines' network);
- `nixl` (nixl.py): the new holder READs the adapter from the holder's GPU
  memory through NIXL (CUDA IPC within a host, GPUDirect RDMA across hosts).
  Run on one H200 (see nixl.py). Where NIXL or a CUDA device is missing, the
  engine uses tcp and says why in one log line; so does a fetch from a peer
  without NIXL, or one whose NIXL offer or READ fails (nixl.py).
"""

from __future__ import annotations

import logging
from typing import Protocol

from vllm_loraserve.cluster.store import AdapterStore

logger = logging.getLogger(f"vllm.{__name__}")
TRANSPORTS = ("tcp", "nixl")


class Transport(Protocol):
    name: str

    async def serve(self, store: AdapterStore) -> str:
        """Start serving `store`; returns the address peers fetch from."""
        ...

    async def fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        """Copy `adapter` from the peer at `address` into `store`; bytes moved.
        Then, before any other await, `last_via` names the path it took."""
        ...

    last_via: str

    async def close(self) -> None: ...


def make_transport(name: str, host: str = "127.0.0.1", device: str = "cuda:0") -> Transport:
    """The transport `name`; `device` is where nixl stages adapters."""
    from vllm_loraserve.cluster.transport.tcp import TcpTransport

    if name == "tcp":
        return TcpTransport(host)
    if name == "nixl":
        try:
            return _nixl(host, device)
        except Exception as e:  # noqa: BLE001 - any reason NIXL cannot start is a fallback
            reason = str(e) or type(e).__name__
            logger.warning("nixl transport unavailable (%s): using tcp", reason)
            return TcpTransport(host)
    raise ValueError(f"unknown transport {name!r}; available: {', '.join(TRANSPORTS)}")


def _nixl(host: str, device: str) -> Transport:
    from vllm_loraserve.cluster.transport.nixl import NixlTransport, make_agent

    agent = make_agent()  # first: its ImportError names the missing module
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    return NixlTransport(agent, device, host)
