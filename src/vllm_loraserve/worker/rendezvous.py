"""Keep torch.distributed's rendezvous store on loopback.

vLLM's workers join torch.distributed through `tcp://HOST:PORT`, even alone
(vllm/v1/executor/uniproc_executor.py), and torch's TCPStore then listens on
every interface (`::`) whatever HOST is. When HOST is a loopback address
(`VLLM_HOST_IP=127.0.0.1`, which the servers this package starts set), this
handler binds the store's listening socket to HOST itself and hands it to
TCPStore (`master_listen_fd`): nothing else changes, as only loopback clients
could reach it anyway. Any other host, rank or torchelastic setup goes to
torch's own handler.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import socket
from urllib.parse import parse_qsl, urlparse

_MARK = "_loraserve_loopback"


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def install() -> None:
    """Idempotent: wraps torch's `tcp://` rendezvous handler once per process."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    # the module: `torch.distributed.rendezvous` as an attribute is the function
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    original = rdzv._rendezvous_handlers["tcp"]
    if getattr(original, _MARK, False):
        return

    def handler(url: str, timeout: timedelta = rdzv.default_pg_timeout, **kwargs):
        parsed = urlparse(url)
        query = dict(parse_qsl(parsed.query))
        if (not _is_loopback(parsed.hostname) or parsed.port is None
                or query.get("rank") != "0" or "world_size" not in query
                or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
            yield from original(url, timeout=timeout, **kwargs)
            return
        listener = socket.create_server((parsed.hostname, parsed.port))
        world_size = int(query["world_size"])
        # TCPStore owns the descriptor from here on (and closes it).
        store = TCPStore(parsed.hostname, parsed.port, world_size, is_master=True,
                         timeout=timeout, master_listen_fd=listener.detach())
        yield store, 0, world_size
        raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")

    setattr(handler, _MARK, True)
    rdzv._rendezvous_handlers["tcp"] = handler
