"""nixl.py's agent calls (`make_agent`, `offer`, `read`) against the real
NIXL (1.5.1, from the cluster bundle), between two processes, in host memory
(DRAM; UCX over TCP: no CUDA here). What this cannot show, VRAM over CUDA
IPC, tests/gpu/test_cluster_gpu.py does. Skipped where nixl is not
installed (the CPU suite's environment); run it with the bundle's nixl on
PYTHONPATH and Python 3.12 (nixl-cu13 is a cp312 wheel):

    PYTHONPATH=src:<dir with nixl, nixl_cu13> python3.12 -m pytest tests/cluster/test_nixl_agent.py

The holder serves two offers one after the other, as an engine serves two
fetches: new registrations change its metadata, which the client loads
anew for each READ and drops after it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl", reason="nixl is not installed (the cluster bundle carries it)")
np = pytest.importorskip("numpy")

from vllm_loraserve.cluster.transport.nixl import make_agent, read  # noqa: E402

SIZES = [(3 << 20) + 7, 1, 70_000]  # bytes per region: odd sizes, many chunks

HOLDER = """
import base64, json, sys
import numpy as np
from vllm_loraserve.cluster.transport.nixl import make_agent, offer

sizes = json.loads(sys.argv[1])
agent = make_agent()
for round in range(2):
    bufs = [np.full(n, 0, np.uint8) for n in sizes]
    for k, b in enumerate(bufs):
        b[:] = (np.arange(b.size) * (k + 3) + round) % 251
    regions = [(b.ctypes.data, b.nbytes, 0) for b in bufs]
    registered, metadata = offer(agent, regions, "DRAM")
    offered = {"metadata": base64.b64encode(metadata).decode(), "regions": regions}
    print("OFFER", json.dumps(offered), flush=True)
    sys.stdin.readline()  # the client read it
    agent.deregister_memory(registered)
"""


def _expected(k: int, n: int, round: int):
    return ((np.arange(n) * (k + 3) + round) % 251).astype(np.uint8)


def _offer(proc) -> dict:
    """The holder's next offer (UCX writes its warnings to stdout too)."""
    for line in proc.stdout:
        if line.startswith("OFFER "):
            return json.loads(line.removeprefix("OFFER "))
    raise AssertionError(f"the holder exited ({proc.wait()}) without an offer")


def test_a_real_nixl_read_between_two_processes_in_host_memory():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(SIZES)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        agent = make_agent()
        for round in range(2):
            offer = _offer(proc)
            bufs = [np.zeros(n, np.uint8) for n in SIZES]
            local = [(b.ctypes.data, b.nbytes, 0) for b in bufs]
            remote = [tuple(r) for r in offer["regions"]]
            seconds = asyncio.run(read(agent, local, remote,
                                       base64.b64decode(offer["metadata"]), "DRAM",
                                       chunk_bytes=1 << 20, timeout_s=60))
            assert seconds > 0
            for k, b in enumerate(bufs):
                assert np.array_equal(b, _expected(k, b.size, round)), (round, k)
            proc.stdin.write("read\n")
            proc.stdin.flush()
        assert proc.wait(60) == 0
        with pytest.raises(ValueError, match="differ in size"):
            asyncio.run(read(agent, local[:1], remote[1:2], b"", "DRAM"))
    finally:
        proc.kill()
