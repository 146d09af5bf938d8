"""torch.distributed's rendezvous store stays on loopback when vLLM asks for it there."""

from __future__ import annotations

import psutil
import torch.distributed as dist

from vllm_loraserve.process import free_port
from vllm_loraserve.worker import rendezvous


def listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_loopback_store_listens_on_loopback_only():
    rendezvous.install()
    rendezvous.install()  # idempotent: wraps once
    port = free_port()
    store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1"))
    store.set("k", "v")
    assert (store.get("k"), rank, world) == (b"v", 0, 1)
    assert listening(port) == {"127.0.0.1"}  # torch alone listens on "::"
    del store
