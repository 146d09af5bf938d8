"""NIXL adapter transport: the new holder READs the adapter's bytes straight
from the holder's GPU memory (NIXL, the transfer library of vLLM's KV
connectors, vllm/distributed/kv_transfer/kv_connector/v1/nixl/: CUDA IPC
within a host, GPUDirect RDMA across hosts, as NIXL's UCX backend picks).

Run on one H200 (2026-11-25, docs/benchmarks/cluster-gpu.md, commit 2787a0c,
before the fallbacks and phases below were added): an adapter moved between
two engines sharing the GPU and answered the same there, but the READ ran at
about 0.5 GB/s (UCX used no CUDA IPC on that machine), slower than tcp end to
end. The agent calls below have also run against the real NIXL 1.5.1 between
two processes in host memory (tests/cluster/test_nixl_agent.py). Cross-host
GPUDirect RDMA cannot be verified on the project's machines, which have no
RDMA NIC. `NixlTransport` logs this once.

The TCP port (tcp.py) carries the control messages, with one more verb:

    client: b"NIXL <name>\\n"
    holder: b"OK <n>\\n" + n bytes of JSON {agent metadata, files, regions}
            (each non-empty file of the adapter staged as one uint8 tensor
            on the holder's device, registered with its agent)
         or b"ERR nixl failed: <why>\\n" when it cannot stage or register
    client: registers its own buffers, READs them chunk by chunk, then b"DONE\\n"
    holder: deregisters and frees the staged copy (also when the client hangs up)

TCP is the fallback, each time with a log line naming why: a peer that does
not know the verb (a tcp engine, or a nixl engine that fell back) answers
`ERR bad request` (logged once per peer); a holder that answers `ERR nixl
failed`, or a READ that fails here, is logged every time. `last_via` says
which path a fetch took. What arrives is written into the store as files,
so vLLM loads it from files as before: the pages in vLLM's worker pool are
not read directly.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
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
NIXL_FAILED = "nixl failed"  # the start of a holder's error that sends the client to tcp
# Files are cut into descriptors of at most this size (both ends cut the
# same way, `chunks`), so a large file need not reach the backend as one
# request; not measured against one descriptor per file.
CHUNK_BYTES = 64 << 20
XFER_TIMEOUT_S = 120.0
HOLD_TIMEOUT_S = 300.0  # the holder frees a staged copy no client finished reading
POLL_S = 0.0005
# UCX's transports for NIXL, unless the environment names others: CUDA IPC
# and copies, plus TCP, which UCX needs to wire up (without it the backend
# does not start), measured on an H200 pair (../shared/device/README.md,
# NIXL: 361 GB/s). UCX reads it when the agent creates its backend.
UCX_TLS = "cuda_ipc,cuda_copy,tcp"

Region = tuple[int, int, int]  # (address, bytes, CUDA device index; 0 in host memory)
Chunk = tuple[int, int, int]  # (region index, offset, bytes)


def memory_of(device: str) -> str:
    """NIXL's memory type for buffers on a torch `device`."""
    return "VRAM" if device.startswith("cuda") else "DRAM"


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


# -- the agent calls (nixl._api.nixl_agent, 1.5.1) ----------------------------

def offer(agent: Any, regions: Sequence[Region], memory: str) -> tuple[Any, bytes]:
    """Register the holder's `regions`; returns the registration (for
    `agent.deregister_memory`) and the agent's metadata, taken after the
    registration, which it then carries (the peer's READ needs it)."""
    registered = agent.register_memory(reg_descs(regions), memory)
    return registered, agent.get_agent_metadata()


async def read(agent: Any, local: Sequence[Region], remote: Sequence[Region], metadata: bytes,
               memory: str, chunk_bytes: int = CHUNK_BYTES,
               timeout_s: float = XFER_TIMEOUT_S) -> float:
    """READ the peer's `remote` regions (described by its `metadata`) into
    `local`, region k into region k; returns the seconds of the READ alone.
    Registers `local` for the READ and leaves nothing registered or loaded."""
    if [n for _, n, _ in local] != [n for _, n, _ in remote]:
        raise ValueError("local and remote regions differ in size")
    cut = chunks([n for _, n, _ in local], chunk_bytes)
    registered = agent.register_memory(reg_descs(local), memory)
    try:
        peer = agent.add_remote_agent(metadata)
        try:
            t0 = time.perf_counter()
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(xfer_descs(local, cut), memory),
                agent.get_xfer_descs(xfer_descs(remote, cut), memory), peer)
            try:
                await _complete(agent, handle, peer, timeout_s)
                return time.perf_counter() - t0
            finally:
                try:
                    agent.release_xfer_handle(handle)
                except Exception as e:  # noqa: BLE001 - an unfinished READ: do not hide why
                    logger.warning("nixl: releasing the READ from %s failed: %s", peer, e)
        finally:
            agent.remove_remote_agent(peer)
    finally:
        agent.deregister_memory(registered)


async def _complete(agent: Any, handle: Any, peer: str, timeout_s: float) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state != "DONE":
        if state == "ERR":
            raise RuntimeError(f"nixl READ from {peer} failed")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nixl READ from {peer} took over {timeout_s:.0f} s")
        await asyncio.sleep(POLL_S)
        state = agent.check_xfer_state(handle)


class NixlTransport(TcpTransport):
    """`agent` is a `nixl._api.nixl_agent` (a fake in tests); `device` the
    torch device staged and received copies live on ("cuda:0": VRAM)."""

    name = "nixl"

    def __init__(self, agent: Any, device: str = "cuda:0", host: str = "127.0.0.1",
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(host)
        self.agent = agent
        self.device = device
        self.memory = memory_of(device)
        self.chunk_bytes = chunk_bytes
        # NIXL's agent is not thread-safe (all calls stay on the event loop)
        # and a peer's metadata is loaded per fetch: one fetch at a time.
        self._fetching = asyncio.Lock()
        self._fell_back: set[str] = set()
        # Seconds of the latest nixl fetch's phases (benchmarks): the holder
        # staging and registering (`hold_s`), the READ (`xfer_s`), the copy
        # to host memory (`copy_s`), the store's write (`store_s`).
        self.last_phases: dict[str, float] = {}
        logger.warning("%s", UNVERIFIED)

    # -- holder --------------------------------------------------------------

    async def answer(self, verb, name, store, reader, writer) -> None:
        if verb != "NIXL":
            return await super().answer(verb, name, store, reader, writer)
        files = adapter_files(store, name)  # KeyError: ERR, as tcp answers
        try:
            staged = await asyncio.to_thread(self._stage, files)
            regions = regions_of([t for _, t in staged if t is not None])
            self._bind_device()
            registered, metadata = offer(self.agent, regions, self.memory)
        except Exception as e:  # noqa: BLE001 - any reason is sent; the client uses tcp
            why = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            logger.warning("nixl: cannot offer %r (%s); the peer will use tcp", name, why)
            writer.write(f"ERR {NIXL_FAILED}: {why}\n".encode())
            return
        try:
            body = json.dumps({
                "metadata": base64.b64encode(metadata).decode(),
                "files": [[p, 0 if t is None else t.numel()] for p, t in staged],
                "regions": [list(r) for r in regions],
            }).encode()
            writer.write(f"OK {len(body)}\n".encode() + body)
            await writer.drain()
            # the client's READ runs without us; hold the copy until it says
            # so or hangs up (readline then returns b"")
            await asyncio.wait_for(reader.readline(), HOLD_TIMEOUT_S)
        except TimeoutError:
            logger.warning("nixl: no client finished reading %r within %.0f s; freed", name,
                           HOLD_TIMEOUT_S)
        finally:
            self.agent.deregister_memory(registered)

    def _stage(self, files: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
        import torch

        out = []
        for rel, full in files:
            with open(full, "rb") as f:
                data = f.read()
            # .to() from pageable memory returns once the copy is done
            out.append((rel, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                        if data else None))
        return out

    def _bind_device(self) -> None:
        """Make the device's CUDA context current on this thread (the event
        loop's), where the agent is called: UCX registers GPU memory through
        the CUDA driver, which looks for a current context, and the staging
        copies ran on another thread. A precaution, not seen to fail yet: a
        runtime call binds the primary context to its thread."""
        if self.memory == "VRAM":
            import torch

            torch.cuda.synchronize(self.device)

    # -- new holder ----------------------------------------------------------

    async def fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        async with self._fetching:
            self.last_phases = {}
            try:
                n = await self._fetch(address, adapter, store)
            except _UseTcp as e:
                if not (e.once and address in self._fell_back):
                    logger.warning("%s: using tcp", e)
                if e.once:
                    self._fell_back.add(address)
                n = await super().fetch(address, adapter, store)
                self.last_via = "tcp"
                return n
        self.last_via = "nixl"  # set with no await before the caller reads it
        return n

    async def _fetch(self, address: str, adapter: str, store: AdapterStore) -> int:
        t0 = time.perf_counter()
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"NIXL {check_name(adapter)}\n".encode())
            await writer.drain()
            status, _, rest = (await reader.readline()).decode().strip().partition(" ")
            if status == "ERR" and rest.startswith(BAD_REQUEST):
                raise _UseTcp(f"peer {address} does not serve nixl ({rest[:80]})", once=True)
            if status == "ERR" and rest.startswith(NIXL_FAILED):
                raise _UseTcp(f"peer {address} could not offer {adapter!r} over nixl "
                              f"({rest[:300]})")
            if status != "OK":
                raise RuntimeError(f"peer {address} could not send {adapter!r}: {rest}")
            n = int(rest)
            if not 0 < n <= 1 << 24:
                raise RuntimeError(f"peer {address} announced a {n}-byte manifest")
            manifest = json.loads(await reader.readexactly(n))
            self.last_phases["hold_s"] = time.perf_counter() - t0
            try:
                files = await self._receive(manifest)
            except Exception as e:  # noqa: BLE001 - the reason goes to the log line
                raise _UseTcp(f"nixl READ of {adapter!r} from {address} failed "
                              f"({type(e).__name__}: {e})") from e
            writer.write(b"DONE\n")
            await writer.drain()
        finally:
            writer.close()
        t0 = time.perf_counter()
        await asyncio.to_thread(store.put_files, adapter, files)
        self.last_phases["store_s"] = time.perf_counter() - t0
        return sum(len(d) for _, d in files)

    async def _receive(self, manifest: dict) -> list[tuple[str, memoryview]]:
        """READ the manifest's files into buffers on `device`; (path, bytes in
        host memory) of each, in the manifest's order."""
        import torch

        check_manifest(manifest["files"], manifest["regions"])
        sizes = [int(n) for _, n in manifest["files"]]
        bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes if n]
        remote = [(int(a), int(n), int(d)) for a, n, d in manifest["regions"]]
        self._bind_device()
        self.last_phases["xfer_s"] = await read(
            self.agent, regions_of(bufs), remote, base64.b64decode(manifest["metadata"]),
            self.memory, self.chunk_bytes)
        t0 = time.perf_counter()
        it = iter(bufs)
        out = [(p, memoryview(next(it).cpu().numpy()) if int(n) else memoryview(b""))
               for p, n in manifest["files"]]
        self.last_phases["copy_s"] = time.perf_counter() - t0
        return out


class _UseTcp(Exception):
    """This fetch goes over tcp; the message says why (`once`: log it once per peer)."""

    def __init__(self, why: str, once: bool = False) -> None:
        super().__init__(why)
        self.once = once


def make_agent() -> Any:
    """A NIXL agent with the UCX backend (vLLM's KV connector's default)."""
    os.environ.setdefault("UCX_TLS", UCX_TLS)
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"loraserve-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))
