"""Transport selection (tcp by default; nixl falls back to tcp with one log
line naming why) and the nixl transport's parts that run without a GPU:
descriptors, chunking, the manifest checks, and its protocol end to end over
loopback with a fake NIXL agent that copies host memory (tests/gpu covers
nothing of it yet: the NIXL path is unverified on a GPU)."""

from __future__ import annotations

import asyncio
import ctypes
import filecmp
import logging
import os
import time

import pytest
import torch

from vllm_loraserve.cluster import transport as transport_pkg
from vllm_loraserve.cluster.store import AdapterStore
from vllm_loraserve.cluster.transport import make_transport
from vllm_loraserve.cluster.transport.nixl import (
    UNVERIFIED,
    NixlTransport,
    check_manifest,
    chunks,
    regions_of,
    xfer_descs,
)
from vllm_loraserve.cluster.transport.tcp import TcpTransport

ADAPTER = "adapter-004-r128"


class Records:
    """The transport loggers' records, each once: vLLM's loggers do not
    propagate to the root logger caplog listens on unless an earlier test
    made them, so listen on them too and count a record seen twice once."""

    def __init__(self, caplog) -> None:
        self.caplog = caplog

    def messages(self) -> list[str]:
        return [r.getMessage() for r in {id(r): r for r in self.caplog.records}.values()]

    def clear(self) -> None:
        self.caplog.clear()


@pytest.fixture
def records(caplog):
    import vllm.logger  # noqa: F401 - its set-up clears the vllm.* handlers first

    log = logging.getLogger("vllm.vllm_loraserve.cluster.transport")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            yield Records(caplog)
    finally:
        log.removeHandler(caplog.handler)


def test_tcp_is_the_default_and_says_nothing(records):
    assert isinstance(make_transport("tcp"), TcpTransport)
    assert not records.messages()
    with pytest.raises(ValueError, match="unknown transport 'rdma'; available: tcp, nixl"):
        make_transport("rdma")


def test_nixl_without_nixl_falls_back_to_tcp_with_one_log_line(records):
    try:
        import nixl  # noqa: F401
        pytest.skip("nixl is installed here")
    except ImportError:
        pass
    t = make_transport("nixl")
    assert type(t) is TcpTransport and t.name == "tcp"
    assert records.messages() == [
        "nixl transport unavailable (No module named 'nixl'): using tcp"]
    assert all(r.levelno == logging.WARNING for r in records.caplog.records)


def test_nixl_without_a_cuda_device_falls_back_with_that_reason(records, monkeypatch):
    from vllm_loraserve.cluster.transport import nixl as nixl_mod

    monkeypatch.setattr(nixl_mod, "make_agent", lambda: FakeAgent())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(make_transport("nixl")) is TcpTransport
    assert records.messages() == [
        "nixl transport unavailable (no CUDA device): using tcp"]
    assert transport_pkg.TRANSPORTS == ("tcp", "nixl")


def test_chunks_pair_by_position_and_cover_every_byte():
    assert chunks([10, 0, 25], 10) == [(0, 0, 10), (2, 0, 10), (2, 10, 10), (2, 20, 5)]
    local = [(1000, 10, 0), (5000, 0, 0), (9000, 25, 0)]
    remote = [(70000, 10, 1), (0, 0, 1), (80000, 25, 1)]
    cut = chunks([n for _, n, _ in local], 10)
    mine, theirs = xfer_descs(local, cut), xfer_descs(remote, cut)
    assert mine == [(1000, 10, 0), (9000, 10, 0), (9010, 10, 0), (9020, 5, 0)]
    assert theirs == [(70000, 10, 1), (80000, 10, 1), (80010, 10, 1), (80020, 5, 1)]
    assert [n for _, n, _ in mine] == [n for _, n, _ in theirs]
    with pytest.raises(ValueError, match="past region"):
        xfer_descs([(0, 5, 0)], [(0, 0, 10)])
    with pytest.raises(ValueError, match="positive"):
        chunks([4], 0)


def test_regions_of_tensors():
    a, b = torch.zeros(7, dtype=torch.uint8), torch.zeros(3, dtype=torch.float32)
    assert regions_of([a, b]) == [(a.data_ptr(), 7, 0), (b.data_ptr(), 12, 0)]
    with pytest.raises(ValueError, match="contiguous"):
        regions_of([torch.zeros(4, 4).t()])


@pytest.mark.parametrize("files, regions, message", [
    ([["a", 3]], [[1, 4, 0]], "do not match"),
    ([["a", 3]], [[1, 3]], "do not match"),
    ([["../x", 3]], [[1, 3, 0]], "outside the adapter"),
    ([["/etc/x", 3]], [[1, 3, 0]], "outside the adapter"),
    ([["a", 17 << 30]], [[1, 17 << 30, 0]], "announced"),
])
def test_a_holders_bad_manifest_is_refused(files, regions, message):
    with pytest.raises(ValueError, match=message):
        check_manifest(files, regions)


class FakeAgent:
    """NIXL 1.5.1's agent calls as nixl.py makes them (nixl_cu13/_api.py's
    signatures), in one process: a READ copies host memory with memmove,
    after checking that both ends lie in memory their agents have registered
    at that moment (test_nixl_agent.py runs the real agent)."""

    by_metadata: dict[bytes, FakeAgent] = {}

    def __init__(self, memory: str = "DRAM", fail_read: bool = False) -> None:
        self.memory, self.fail_read = memory, fail_read
        self.metadata = os.urandom(8)
        FakeAgent.by_metadata[self.metadata] = self
        self.registered: list[tuple[int, int, int]] = []
        self.remotes: dict[str, FakeAgent] = {}
        self.reads = 0
        self.handles = 0  # transfer handles not released yet

    def get_xfer_descs(self, descs, mem_type=None):
        assert mem_type == self.memory and all(len(d) == 3 for d in descs)
        return list(descs)

    def register_memory(self, reg_list, mem_type=None, backends=()):
        assert mem_type == self.memory and all(len(d) == 4 for d in reg_list)
        assert reg_list, "the real get_reg_descs fails on an empty list"
        descs = [d[:3] for d in reg_list]
        self.registered += descs
        return descs

    def deregister_memory(self, dereg_list, backends=()):
        for d in dereg_list:
            self.registered.remove(d)

    def get_agent_metadata(self):
        return self.metadata

    def add_remote_agent(self, metadata):
        name = f"peer-{metadata.hex()}"
        assert name not in self.remotes
        self.remotes[name] = FakeAgent.by_metadata[metadata]
        return name

    def remove_remote_agent(self, agent):
        del self.remotes[agent]

    def _inside(self, addr, n):
        return any(a <= addr and addr + n <= a + size for a, size, _ in self.registered)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent,
                        notif_msg=b"", backends=()):
        assert operation == "READ" and len(local_descs) == len(remote_descs)
        self.handles += 1
        return (local_descs, remote_descs, self.remotes[remote_agent])

    def transfer(self, handle, notif_msg=b""):
        local, remote, peer = handle
        if self.fail_read:
            return "ERR"
        for (dst, n, _), (src, m, _) in zip(local, remote, strict=True):
            assert n == m and self._inside(dst, n) and peer._inside(src, m)
            ctypes.memmove(dst, src, n)
        self.reads += 1
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def release_xfer_handle(self, handle):
        self.handles -= 1


def _same_tree(a: str, b: str) -> bool:
    cmp = filecmp.dircmp(a, b)
    return not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files)


def test_nixl_protocol_round_trip_with_a_fake_agent(tiny_assets, tmp_path, records):
    holder = AdapterStore(str(tmp_path / "holder"))
    holder.copy_in(ADAPTER, os.path.join(tiny_assets, "adapters", ADAPTER))
    target = AdapterStore(str(tmp_path / "target"))
    holder_agent, client_agent = FakeAgent(), FakeAgent()
    # small chunks: a file is read in many pieces that must land in order
    server = NixlTransport(holder_agent, "cpu", chunk_bytes=4096)
    client = NixlTransport(client_agent, "cpu", chunk_bytes=4096)
    assert records.messages() == [UNVERIFIED, UNVERIFIED]

    async def body():
        address = await server.serve(holder)
        try:
            n = await client.fetch(address, ADAPTER, target)
            assert n == holder.size_bytes(ADAPTER) and client.last_via == "nixl"
            assert _same_tree(holder.path(ADAPTER), target.path(ADAPTER))
            assert client_agent.reads == 1 and client_agent.handles == 0
            assert set(client.last_phases) == {"hold_s", "xfer_s", "copy_s", "store_s"}
            await _wait_freed(holder_agent)  # the holder frees its copy once it reads DONE
            assert holder_agent.registered == [] and client_agent.registered == []
            assert client_agent.remotes == {}
            with pytest.raises(RuntimeError, match="could not send 'absent'"):
                await client.fetch(address, "absent", target)
            # a tcp client still fetches from a nixl holder
            other = AdapterStore(str(tmp_path / "other"))
            await TcpTransport().fetch(address, ADAPTER, other)
            assert _same_tree(holder.path(ADAPTER), other.path(ADAPTER))
        finally:
            await server.close()
    asyncio.run(body())


def test_nixl_client_uses_tcp_from_a_tcp_peer_with_one_log_line(tiny_assets, tmp_path,
                                                                 records):
    holder = AdapterStore(str(tmp_path / "holder"))
    holder.copy_in(ADAPTER, os.path.join(tiny_assets, "adapters", ADAPTER))
    target = AdapterStore(str(tmp_path / "target"))
    server, agent = TcpTransport(), FakeAgent()
    client = NixlTransport(agent, "cpu")
    records.clear()

    async def body():
        address = await server.serve(holder)
        try:
            for _ in range(2):
                assert await client.fetch(address, ADAPTER, target) > 0
                assert client.last_via == "tcp"
            assert _same_tree(holder.path(ADAPTER), target.path(ADAPTER))
            assert agent.reads == 0
            assert records.messages() == [
                f"peer {address} does not serve nixl (bad request 'NIXL'): using tcp"]
        finally:
            await server.close()
    asyncio.run(body())


async def _wait_freed(agent: FakeAgent) -> None:
    """Until the holder freed its copy (once the client read it or hung up),
    at most 30 s: a loaded machine can take seconds."""
    deadline = time.monotonic() + 30
    while agent.registered and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_a_failed_nixl_read_falls_back_to_tcp_each_time_with_its_reason(tiny_assets, tmp_path,
                                                                        records):
    holder = AdapterStore(str(tmp_path / "holder"))
    holder.copy_in(ADAPTER, os.path.join(tiny_assets, "adapters", ADAPTER))
    holder_agent, client_agent = FakeAgent(), FakeAgent(fail_read=True)
    server, client = NixlTransport(holder_agent, "cpu"), NixlTransport(client_agent, "cpu")
    records.clear()

    async def body():
        address = await server.serve(holder)
        try:
            for i in range(2):
                target = AdapterStore(str(tmp_path / f"target{i}"))
                assert await client.fetch(address, ADAPTER, target) > 0
                assert client.last_via == "tcp"
                assert _same_tree(holder.path(ADAPTER), target.path(ADAPTER))
                await _wait_freed(holder_agent)
                assert holder_agent.registered == [] and client_agent.registered == []
                assert client_agent.remotes == {} and client_agent.handles == 0
        finally:
            await server.close()
    asyncio.run(body())
    why = f"nixl READ of {ADAPTER!r} from 127.0.0.1:"
    logged = records.messages()
    assert len(logged) == 2 and all(m.startswith(why) for m in logged), logged
    assert all(m.endswith("failed (RuntimeError: nixl READ from "
                          f"peer-{holder_agent.metadata.hex()} failed): using tcp")
               for m in logged), logged


def test_a_holder_that_cannot_offer_sends_the_client_to_tcp(tiny_assets, tmp_path, records):
    holder = AdapterStore(str(tmp_path / "holder"))
    holder.copy_in(ADAPTER, os.path.join(tiny_assets, "adapters", ADAPTER))
    target = AdapterStore(str(tmp_path / "target"))
    server = NixlTransport(FakeAgent(), "cuda:7")  # staging there fails on this machine
    client = NixlTransport(FakeAgent(), "cpu")
    records.clear()

    async def body():
        address = await server.serve(holder)
        try:
            assert await client.fetch(address, ADAPTER, target) > 0
            assert client.last_via == "tcp"
            assert _same_tree(holder.path(ADAPTER), target.path(ADAPTER))
        finally:
            await server.close()
        return address
    address = asyncio.run(body())
    logged = records.messages()
    assert len(logged) == 2, logged
    assert logged[0].startswith(f"nixl: cannot offer {ADAPTER!r} (")
    assert logged[1].startswith(f"peer {address} could not offer {ADAPTER!r} over nixl "
                                "(nixl failed: ") and logged[1].endswith(": using tcp")
