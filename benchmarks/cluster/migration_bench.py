"""Adapter migration between two processes: tcp against nixl, per adapter size.

    python benchmarks/cluster/migration_bench.py --transports tcp,nixl --ranks 8,32,128 \\
        --reps 10 --out $OUT/migration-bench.json

A holder process (this file with `--holder`) serves a store of adapters over
each transport, as a cluster engine's actor does; this process fetches each
adapter from it `--reps` + 1 times into fresh stores, as a new holder does.
Two processes, because NIXL moves GPU memory between processes with CUDA IPC
but crawls within one (0.44 GB/s, ../shared/device/README.md). On one GPU
both processes use it, as two engines sharing it do.

The adapters have the byte sizes of PEFT adapters of the Llama-2-7B shape on
q,k,v,o (bf16; rank 8: 16.8 MB, rank 128: 268 MB); their tensor bytes are
random, since the transports move files without reading them.

Recorded per transport and size: the first fetch alone (it includes
connecting, and for nixl each process's first CUDA allocation and UCX's
first CUDA IPC mapping), then the median and min of the rest, in seconds
and GB/s of the adapter's bytes. For nixl, the median of each phase
(`NixlTransport.last_phases`): the holder staging the files onto its GPU
and registering them (`hold_s`, with the control round trip), the NIXL READ
alone (`xfer_s`, and its GB/s), the copy to host memory (`copy_s`) and the
store's write (`store_s`). Where nixl is not installed or there is no GPU,
the nixl entry says why (the reason an engine would log when it falls back
to tcp). The time from a placement decision to the first request served by
the new holder needs engines: tests/gpu/test_cluster_gpu.py measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_loraserve.cluster.store import AdapterStore
from vllm_loraserve.cluster.transport import make_transport
from vllm_loraserve.cluster.transport.nixl import UCX_TLS

HIDDEN, LAYERS, MODULES = 4096, 32, 4  # Llama-2-7B, q,k,v,o: A [r, 4096] and B [4096, r]


def adapter_bytes(rank: int) -> int:
    return LAYERS * MODULES * rank * 2 * HIDDEN * 2


def write_adapter(path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, f)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        left = adapter_bytes(rank)
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


def holder(store_root: str, transport: str, address_file: str) -> None:
    """Serve the store until stdin closes; the address goes to `address_file`."""
    async def main():
        t = make_transport(transport)
        address = await t.serve(AdapterStore(store_root))
        with open(address_file + ".tmp", "w") as f:
            json.dump({"address": address, "transport": t.name}, f)
        os.replace(address_file + ".tmp", address_file)
        await asyncio.to_thread(sys.stdin.read)
        await t.close()
    asyncio.run(main())


def start_holder(store_root: str, transport: str, work: str) -> tuple[subprocess.Popen, dict]:
    address_file = os.path.join(work, f"holder-{transport}.json")
    proc = subprocess.Popen([sys.executable, __file__, "--holder", store_root, transport,
                             address_file], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not os.path.exists(address_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {transport} holder did not start (exit {proc.poll()})")
        time.sleep(0.1)
    return proc, json.load(open(address_file))


class _Captured(logging.Handler):
    """The transport package's log lines (why nixl fell back) for the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _client(transport: str):
    log = logging.getLogger("vllm.vllm_loraserve.cluster.transport")
    captured = _Captured()
    log.addHandler(captured)
    try:
        return make_transport(transport), captured.lines
    finally:
        log.removeHandler(captured)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


async def measure(transport: str, names: dict[str, int], store_root: str, reps: int,
                  work: str) -> dict:
    client, lines = _client(transport)
    if client.name != transport:
        why = next((m for m in lines if "unavailable" in m), f"{transport} fell back to tcp")
        return {"unavailable": why}
    proc, info = start_holder(store_root, transport, work)
    try:
        if info["transport"] != transport:
            return {"unavailable": f"the holder process fell back to {info['transport']}"}
        rows = []
        for name, rank in names.items():
            times, phases = [], []
            for _ in range(reps + 1):
                target = AdapterStore(tempfile.mkdtemp(dir=work))
                t0 = time.perf_counter()
                n = await client.fetch(info["address"], name, target)
                times.append(time.perf_counter() - t0)
                if client.last_via != transport:
                    raise RuntimeError(f"a {transport} fetch went over {client.last_via}")
                phases.append(dict(getattr(client, "last_phases", {})))
                assert target.size_bytes(name) == AdapterStore(store_root).size_bytes(name)
                target.remove(name)
            rest = times[1:]
            row = {"adapter": name, "rank": rank, "bytes": n, "first_s": round(times[0], 4),
                   "median_s": _median(rest), "min_s": round(min(rest), 4),
                   "median_gb_s": round(n / statistics.median(rest) / 1e9, 3)}
            if phases[0]:
                row["first_phases_s"] = {k: round(v, 4) for k, v in phases[0].items()}
                row["median_phases_s"] = {k: _median([p[k] for p in phases[1:]])
                                          for k in phases[0]}
                row["xfer_gb_s"] = round(n / row["median_phases_s"]["xfer_s"] / 1e9, 2)
            print(json.dumps({"transport": transport, **row}), flush=True)
            rows.append(row)
        await client.close()
        return {"rows": rows}
    finally:
        proc.stdin.close()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--holder", nargs=3, metavar=("STORE", "TRANSPORT", "ADDRESS_FILE"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--transports", default="tcp,nixl")
    ap.add_argument("--ranks", default="8,32,128")
    ap.add_argument("--reps", type=int, default=10, help="fetches after the first")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.holder:
        holder(*a.holder)
        return 0
    work = tempfile.mkdtemp(prefix="migration-bench-")
    store_root = os.path.join(work, "holder")
    names = {f"r{r}": int(r) for r in a.ranks.split(",")}
    for name, rank in names.items():
        write_adapter(os.path.join(store_root, name), rank)
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "host": platform.node(), "commit": os.environ.get("LORASERVE_COMMIT", "unknown"),
              "device": _device(), "versions": _versions(),
              "ucx_tls": os.environ.get("UCX_TLS", f"{UCX_TLS} (nixl.py's default)"),
              "reps": a.reps, "transports": {}}
    failed = False
    for transport in a.transports.split(","):
        try:
            result["transports"][transport] = asyncio.run(
                measure(transport, names, store_root, a.reps, work))
        except Exception as e:  # the other transport's rows still count
            failed = True
            result["transports"][transport] = {"error": f"{type(e).__name__}: {e}"}
        if a.out:  # after each transport: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result["transports"], indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("vllm", "torch", "nixl", "nixl-cu13", "ray"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def _device() -> str:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
