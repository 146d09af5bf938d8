"""NIXL adapter transport: the new holder READs the adapter's bytes straight
from the holder's GPU memory (NIXL, the transfer library of vLLM's KV
connectors, vllm/distributed/kv_transfer/kv_connector/v1/nixl/: CUDA IPC
within a host, GPUDirect RDMA across hosts, as NIXL's UCX backend picks).

Run on one H200 (2026-11-25, docs/benchmarks/cluster-gpu.md): an adapter
moved between two engines sharing the GPU and answered the same there, but
the READ ran at about 0.5 GB/s (UCX used no CUDA IPC on that machine), slower
than tcp end to end. Cross-host GPUDirect RDMA cannot be verified on the
project's machines, which have no RDMA NIC. `NixlTransport` logs this once.

The TCP port (tcp.py) carries the control messages, with one more verb:

    client: b"NIXL <name>\\n"
    holder: b"OK <n>\\n" + n bytes of JSON {agent metadata, files, regions}
            (each non-empty file of the adapter staged as one uint8 tensor
            on the holder's GPU, registered with its agent)
    client: registers its own buffers, READs them chunk by chunk, then b"DONE\\n"
    holder: deregisters and frees the staged copy

A peer that does not know the verb (a tcp engine, or a nixl engine that fell
back) answers `ERR bad request`, and the adapter comes over TCP instead, with
a log line naming the peer. What arrives is unpacked into the store as the
TCP transport does, so vLLM loads it from files as before: the pages in vLLM's
worker pool are not read directly.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import tarfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from vllm_loraserve.adapters.safety import resolve_adapter_under_roots
from vllm_loraserve.cluster.store import AdapterStore, check_name
from vllm_loraserve.cluster.transport.tcp import BAD_REQUEST, MAX_ADAPTER_BYTES, TcpTransport

logger = logging.getLogger(f"vllm.{__name__}")
UNVERIFIED = ("nixl transport: measured only between processes on one GPU, where it moved "
              "0.5 GB/s (no CUDA IPC there); cross-host GPUDirect RDMA is unverified (no RDMA "
              "NIC on the project's machines)")
MEMORY = "VRAM"
# One descriptor per chunk, so NIXL can spread a large file over its backend's
# worker threads (nixl_agent_config num_threads) instead of one long request.
CHUNK_BYTES = 64 << 20
XFER_TIMEOUT_S = 120.0
HOLD_TIMEOUT_S = 300.0  # the holder frees a staged copy no client finished reading

Region = tuple[int, int, int]  # (address, bytes, CUDA device index)
Chunk = tuple[int, int, int]  # (region index, offset, bytes)


def regions_of(tensors: Sequence[Any]) -> list[Region]:
    """NIXL regions of contiguous tensors: one per tensor, in order."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("NIXL reads contiguous memory only")
        out.append((t.data_ptr(), t.numel() * t.element_size(),
                    t.device.index if t.device.index is not None else 0))
    return out


def chunks(sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Cut regions of `sizes` bytes into pieces of at most `chunk_bytes`.
    Both ends cut the same sizes the same way, so the k-th local descriptor
    pairs with the k-th remote one (a READ pairs its two lists by position)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk size must be positive, not {chunk_bytes}")
    return [(r, off, min(chunk_bytes, size - off))
            for r, size in enumerate(sizes) for off in range(0, size, chunk_bytes)]


def xfer_descs(regions: Sequence[Region], cut: Sequence[Chunk]) -> list[Region]:
    """The (address, bytes, device) transfer descriptors of `cut` over `regions`."""
    out = []
    for r, off, n in cut:
        addr, size, dev = regions[r]
        if off + n > size:
            raise ValueError(f"chunk {off}+{n} past region {r} of {size} bytes")
        out.append((addr + off, n, dev))
    return out


def reg_descs(regions: Sequence[Region]) -> list[tuple[int, int, int, str]]:
    """`get_reg_descs`'s 4-tuples (the last field, a name, is unused here)."""
    return [(addr, n, dev, "") for addr, n, dev in regions]


def check_manifest(files: Sequence[Sequence[Any]], regions: Sequence[Sequence[int]]) -> int:
    """Total bytes of a holder's answer, or ValueError: one (address, bytes,
    device) region per non-empty file, of its size, relative paths only,
    within the limit."""
    sizes = [int(n) for _, n in files]
    if any(len(r) != 3 for r in regions) or [n for n in sizes if n] != [int(r[1]) for r in regions]:
        raise ValueError("the holder's regions do not match its files")
    for path, _ in files:
        if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"the holder named a file outside the adapter: {path!r}")
    total = sum(sizes)
    if total > MAX_ADAPTER_BYTES:
        raise ValueError(f"the holder announced {total} bytes")
    return total


def pack(name: str, files: Sequence[tuple[str, bytes]]) -> bytes:
    """The files as the tar `AdapterStore.put_tar` unpacks (its checks apply)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, data in files:
            info = tarfile.TarInfo(f"{name}/{path}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def adapter_files(store: AdapterStore, name: str) -> list[tuple[str, str]]:
    """(relative path, absolute path) of the adapter's files, sorted; a file
    resolving outside the store is refused, as `AdapterStore.tar` does."""
    if not store.has(name):
        raise KeyError(f"adapter {name!r} is not in this store")
    root = resolve_adapter_under_roots(store.path(name), [store.root])
    out = []
    for d, _, names in os.walk(root):
        for f in names:
            full = os.path.join(d, f)
            out.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return sorted(out)


class NixlTransport(TcpTransport):
    """`agent` is a `nixl._api.nixl_agent` (a fake in tests); `device` the
    torch device staged and received copies live on."""

    name = "nixl"

    def __init__(self, agent: Any, device: str = "cuda:0", host: str = "127.0.0.1",
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(host)
        self.agent = agent
        self.device = device
        self.chunk_bytes = chunk_bytes
        # NIXL's agent is not thread-safe and a peer's metadata is loaded per
        # fetch: one fetch at a time per engine.
        self._fetching = asyncio.Lock()
        self._fell_back: set[str] = set()
        logger.warning("%s", UNVERIFIED)

    # -- holder --------------------------------------------------------------

    async def answer(self, verb, name, store, reader, writer) -> None:
        if verb != "NIXL":
            return await super().answer(verb, name, store, reader, writer)
        files = adapter_files(store, name)
        staged = await asyncio.to_thread(self._stage, files)
        regions = regions_of([t for _, t in staged if t is not None])
        descs = self.agent.get_reg_descs(reg_descs(regions), MEMORY)
        self.agent.register_memory(descs)
        try:
            body = json.dumps({
                # metadata after registration: it carries the registered segments
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "files": [[p, 0 if t is None else t.numel()] for p, t in staged],
                "regions": [list(r) for r in regions],
            }).encode()
            writer.write(f"OK {len(body)}\n".encode() + body)
            await writer.drain()
            # the client's READ runs without us; hold the copy until it says so
            await asyncio.wait_for(reader.readline(), HOLD_TIMEOUT_S)
        except TimeoutError:
            logger.warning("nixl: no client finished reading %r within %.0f s; freed", name,
                           HOLD_TIMEOUT_S)
        finally:
            self.agent.deregister_memory(descs)

    def _stage(self, files: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
        import torch

        out = []
        for rel, full in files:
            with open(full, "rb") as f:
                data = f.read()
            out.append((rel, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                        if data else None))
        return out

    # -- new holder ----------------------------------------------------------

    async def fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        async with self._fetching:
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(f"NIXL {check_name(adapter)}\n".encode())
                await writer.drain()
                status, _, rest = (await reader.readline()).decode().strip().partition(" ")
                if status == "ERR" and rest.startswith(BAD_REQUEST):
                    if address not in self._fell_back:
                        self._fell_back.add(address)
                        logger.warning("peer %s does not serve nixl (%s): using tcp from it",
                                       address, rest[:80])
                    n = await super().fetch(address, adapter, store)
                    self.last_via = "tcp"
                    return n
                if status != "OK":
                    raise RuntimeError(f"peer {address} could not send {adapter!r}: {rest}")
                n = int(rest)
                if not 0 < n <= 1 << 24:
                    raise RuntimeError(f"peer {address} announced a {n}-byte manifest")
                manifest = json.loads(await reader.readexactly(n))
                files = await self._read(manifest)
                writer.write(b"DONE\n")
                await writer.drain()
            finally:
                writer.close()
        await asyncio.to_thread(store.put_tar, adapter, pack(adapter, files))
        self.last_via = "nixl"  # set with no await before the caller reads it
        return sum(len(d) for _, d in files)

    async def _read(self, manifest: dict) -> list[tuple[str, bytes]]:
        import torch

        check_manifest(manifest["files"], manifest["regions"])
        sizes = [int(n) for _, n in manifest["files"]]
        bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes if n]
        local = regions_of(bufs)
        remote = [(int(a), int(n), int(d)) for a, n, d in manifest["regions"]]
        cut = chunks([n for _, n, _ in local], self.chunk_bytes)
        descs = self.agent.get_reg_descs(reg_descs(local), MEMORY)
        self.agent.register_memory(descs)
        peer = self.agent.add_remote_agent(base64.b64decode(manifest["metadata"]))
        t0 = time.perf_counter()
        try:
            await self._transfer(self.agent.get_xfer_descs(xfer_descs(local, cut), MEMORY),
                                 self.agent.get_xfer_descs(xfer_descs(remote, cut), MEMORY),
                                 peer)
        finally:
            self.agent.remove_remote_agent(peer)
            self.agent.deregister_memory(descs)
        self.last_xfer_s = time.perf_counter() - t0  # the READ alone (benchmarks)
        it = iter(bufs)
        return [(p, next(it).cpu().numpy().tobytes() if int(n) else b"")
                for p, n in manifest["files"]]

    async def _transfer(self, local: Any, remote: Any, peer: str) -> None:
        handle = self.agent.initialize_xfer("READ", local, remote, peer)
        if not handle:
            raise RuntimeError(f"nixl could not create a READ from {peer}")
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + XFER_TIMEOUT_S
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"nixl READ from {peer} failed")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nixl READ from {peer} took over {XFER_TIMEOUT_S} s")
                await asyncio.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)


def make_agent() -> Any:
    """A NIXL agent with the UCX backend (vLLM's KV connector's default).
    UCX's transports default to the set measured on an H200 pair
    (../shared/device/README.md): CUDA IPC and copies, and TCP, which UCX
    needs to wire up (without it the backend does not start)."""
    os.environ.setdefault("UCX_TLS", "cuda_ipc,cuda_copy,tcp")
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"loraserve-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))
