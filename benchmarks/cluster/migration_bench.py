"""Adapter migration between two processes: tcp against nixl, per adapter size.

    python benchmarks/cluster/migration_bench.py --transports tcp,nixl --ranks 8,32,128 \\
        --reps 5 --out $OUT/migration.json

A holder process (this file with `--holder`) serves a store of adapters over
each transport, as a cluster engine's actor does; this process fetches each
adapter from it `--reps` times into fresh stores, as a new holder does. Two
processes, because NIXL moves GPU memory between processes with CUDA IPC but
crawls within one (0.44 GB/s, ../shared/device/README.md).

The adapters have the byte sizes of PEFT adapters of the Llama-2-7B shape on
q,k,v,o (bf16; rank 8: 16.8 MB, rank 128: 268 MB); their tensor bytes are
random, since the transports move files without reading them.

Recorded per transport and size: the first fetch, the median and the min of
the rest (seconds and GB/s of the adapter's bytes), and for nixl the NIXL
READ alone (`NixlTransport.last_xfer_s`); the rest of a nixl fetch is the
holder staging the files onto its GPU, the copy back to host memory and the
store's write. Where nixl is not installed or there is no GPU, the nixl rows
say why, and the engine would fall back to tcp (transport/__init__.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_loraserve.cluster.store import AdapterStore
from vllm_loraserve.cluster.transport import make_transport

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


async def measure(transport: str, names: dict[str, int], store_root: str, reps: int,
                  work: str) -> dict:
    proc, info = start_holder(store_root, transport, work)
    try:
        client = make_transport(transport)
        if client.name != transport or info["transport"] != transport:
            return {"unavailable": f"{transport} fell back to tcp here (see the log line)"}
        rows = []
        for name, rank in names.items():
            times, xfers = [], []
            for _ in range(reps + 1):
                target = AdapterStore(tempfile.mkdtemp(dir=work))
                t0 = time.perf_counter()
                n = await client.fetch(info["address"], name, target)
                times.append(time.perf_counter() - t0)
                xfers.append(getattr(client, "last_xfer_s", None))
                assert target.size_bytes(name) == AdapterStore(store_root).size_bytes(name)
                target.remove(name)
            rest = times[1:]
            row = {"adapter": name, "rank": rank, "bytes": n, "first_s": round(times[0], 4),
                   "median_s": round(statistics.median(rest), 4),
                   "min_s": round(min(rest), 4),
                   "median_gb_s": round(n / statistics.median(rest) / 1e9, 3)}
            if xfers[1] is not None:
                x = statistics.median(xfers[1:])
                row |= {"xfer_median_s": round(x, 4), "xfer_gb_s": round(n / x / 1e9, 2)}
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
    ap.add_argument("--reps", type=int, default=5)
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
              "device": _device(), "reps": a.reps, "transports": {}}
    for transport in a.transports.split(","):
        result["transports"][transport] = asyncio.run(
            measure(transport, names, store_root, a.reps, work))
    print(json.dumps(result["transports"], indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _device() -> str:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
