"""The engine thread's host time for one page load, while the GPU is busy.

In the e2e protocol (Llama-3-8B all-linear, 200 adapters), the timed run's
70 page loads took 4.8 s of the engine thread's time (`gpu_load_s_timed`),
about 68 ms each, and the GPU was idle 16% of the run. A load issues
asynchronous work only (worker/paged_manager.py `_load`: one pinned
host-to-device copy, the packing on the device, the page writes), so its
host time should not depend on how much work the GPU has queued. This
script checks that: it queues `--busy-ms` of GPU work (`torch.cuda._sleep`),
then times the load's host calls, as the engine does them, from the host
tier's pinned arena, for adapters of the e2e shape. If a call waits for the
GPU, its host time grows with `--busy-ms`. Under torch's sync debug mode, each
synchronizing torch call is counted, and the first one's stack is kept.
`--readers` runs host-tier reads beside the loads (the engine's reader
threads share its process, and its GIL; `--read-in processes` reads in
reader processes instead, as `--loraserve-read-in processes` does);
`--free-gb` leaves the device nearly full, as an engine's KV cache does
(the caching allocator's retries and frees are reported); `--switch-us`
sets the Python thread switch interval, how long a thread that wants the
GIL waits before asking its holder for it.
`--paths` picks the load paths timed, as the engine takes them:
- `torch`: the file's bytes copied, packed with torch (`pack_layers`), the
  pages written (`--loraserve-pack torch`);
- `table`: the same with the one-launch pack (worker/pack_tables.py, the
  default on CUDA);
- `pipelined`: worker/cold_start.py's `ColdStart.load` with the one-launch
  pack, every layer group's copy, pack and page write queued on a side
  stream (`--loraserve-cold-start pipelined`, the default on CUDA); its
  `pack_ms` and `write_ms` are the groups' own, `total_ms` adds the slot
  table's row and the lane's start.

    python benchmarks/e2e/load_host_time.py --paths torch,table,pipelined --out load_host_time.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from vllm_loraserve.plugin import use_registered_pinned_memory

use_registered_pinned_memory(os.environ)  # as the engine's processes, before CUDA starts

import torch  # noqa: E402

from vllm_loraserve.adapters.peft import read_weights, short_name, write_adapter  # noqa: E402
from vllm_loraserve.paging.layout import pack_layers  # noqa: E402
from vllm_loraserve.paging.model import decoder_slices, max_file_bytes, model_layout  # noqa: E402
from vllm_loraserve.paging.step import PageLoad  # noqa: E402
from vllm_loraserve.worker.arena import PinnedArena  # noqa: E402
from vllm_loraserve.worker.cold_start import ColdStart, layer_groups  # noqa: E402
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks  # noqa: E402
from vllm_loraserve.worker.file_readers import ReaderProcesses  # noqa: E402
from vllm_loraserve.worker.host_tier import HostAdapter  # noqa: E402
from vllm_loraserve.worker.pack_tables import TablePacker, file_table  # noqa: E402
from vllm_loraserve.worker.pool import DevicePool  # noqa: E402

LLAMA3 = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, num_hidden_layers=32)
DEFAULT_SWITCH = sys.getswitchinterval()
PAGE = 32768  # the e2e engine's page: 16 tokens x 8 KV heads x 128 x 2 (K and V)
GROUP_LAYERS = 4  # the engine's --loraserve-cold-start-group-layers default
PATHS = ("torch", "table", "pipelined")
MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
             "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(root: str, rank: int, seed: int) -> str:
    path = os.path.join(root, f"r{rank}-{seed}")
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        g = torch.Generator().manual_seed(seed)
        weights = {f"model.layers.{la}.{MODULE_OF[s.name]}.{s.name}": (
            torch.randn(rank, s.in_features, generator=g).bfloat16() * 0.01,
            torch.randn(s.out_features, rank, generator=g).bfloat16() * 0.01)
            for la in range(LLAMA3.num_hidden_layers) for s in decoder_slices(LLAMA3)}
        write_adapter(path, weights, rank=rank, alpha=2 * rank, base_model="x")
    return path


def host_entry(layout, arena: PinnedArena, path: str) -> HostAdapter:
    spec, raw = read_weights(path, lambda n: arena.view(arena.alloc(n), n),
                             torch.finfo(torch.bfloat16).max)
    where = {name: (int(name.split(".")[2]), short_name(name)) for name in raw.modules}
    placement = layout.place(spec.rank, spec.target_modules)
    return HostAdapter(path, placement, spec.scaling, raw, where,
                       file_table(layout, LLAMA3.num_hidden_layers, placement, raw, where))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="16,32,64")
    ap.add_argument("--busy-ms", default="0,50", help="GPU work queued before each load")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--readers", default="0",
                    help="host-tier reads running beside the loads (threads reading the "
                         "adapters in a loop, their reads split over as many part threads, "
                         "as the engine's host tier does)")
    ap.add_argument("--read-in", default="threads",
                    help="where the readers' reads run (--loraserve-read-in): threads of "
                         "this process, processes (worker/file_readers.py), or both, "
                         "comma-separated")
    ap.add_argument("--switch-us", default="0",
                    help="the process's Python thread switch interval (sys.setswitchinterval) "
                         "in us; 0: Python's default, 5 ms")
    ap.add_argument("--free-gb", type=float, default=0,
                    help="leave only this much device memory free, as an engine whose KV "
                         "cache took the rest (0: no filling)")
    ap.add_argument("--paths", default="torch", help=f"load paths timed, of {PATHS}")
    ap.add_argument("--root", default="/dev/shm/load-host-time")
    ap.add_argument("--out", default="load_host_time.json")
    a = ap.parse_args()
    paths = a.paths.split(",")
    if not set(paths) <= set(PATHS):
        ap.error(f"--paths takes {PATHS}")
    dev = torch.device("cuda")
    layout = model_layout(LLAMA3, PAGE)
    ranks = [int(r) for r in a.ranks.split(",")]
    arena = PinnedArena.for_budget(4 << 30, max_file_bytes(LLAMA3, max(ranks)), pinned=True)
    entries = {r: host_entry(layout, arena, make_adapter(a.root, r, r)) for r in ranks}
    pages_needed = max(e.placement.num_pages for e in entries.values())
    kv = [torch.zeros(4 * pages_needed + 8, PAGE, dtype=torch.bfloat16, device=dev)
          for _ in range(LLAMA3.num_hidden_layers)]
    pool = DevicePool(layout.slices, LLAMA3.num_hidden_layers, max(ranks), 8192, 64, 3,
                      "triton", dev)
    pool.bind(kv)
    packer = TablePacker(layout, LLAMA3.num_hidden_layers, torch.bfloat16, dev)
    packer.warm_up()
    groups = layer_groups(LLAMA3.num_hidden_layers, GROUP_LAYERS)
    grouped = DevicePool(layout.slices, LLAMA3.num_hidden_layers, max(ranks), 8192, 64, 3,
                         "triton", dev, layer_groups=groups)
    grouped.bind([torch.zeros_like(t) for t in kv])

    def pack_table(entry: HostAdapter, layers: range, data: torch.Tensor) -> torch.Tensor:
        streams = packer.pack(entry, data, layers)
        if streams is None:  # the engine packs with torch then (`_device_streams`)
            raise RuntimeError("a pack table's staging row was busy: rerun with fewer ranks")
        return streams

    failed: list[str] = []
    cold = ColdStart("pipelined", grouped, dev, torch.cuda.Stream(dev), pack_table,
                     lambda load, why, error=None: failed.append(why), lambda load, s: None,
                     None)
    cold.warm_up()
    # cycles per ms of torch.cuda._sleep on this GPU
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    torch.cuda._sleep(100_000_000)
    t[1].record()
    torch.cuda.synchronize()
    cycles_per_ms = 100_000_000 / t[0].elapsed_time(t[1])

    def load(entry: HostAdapter, slot: int, path: str = "torch") -> dict:
        ids = tuple(range(1 + slot * pages_needed, 1 + slot * pages_needed
                          + entry.placement.num_pages))
        if path == "pipelined":
            cold.begin_step()  # the last load's groups are in place (the main stream waits)
            pack0, write0 = cold.pack_s, cold.write_s
            request = SimpleNamespace(lora_int_id=slot + 1, lora_name=f"slot{slot}")
            t0 = time.perf_counter()
            cold.load([(PageLoad(slot, request, entry.placement.rank, ids), entry)])
            t1 = time.perf_counter()
            if failed:
                raise RuntimeError(f"a pipelined load failed: {failed[0]}")
            return {"copy_ms": 0.0, "pack_ms": (cold.pack_s - pack0) * 1e3,
                    "write_ms": (cold.write_s - write0) * 1e3, "total_ms": (t1 - t0) * 1e3}
        t0 = time.perf_counter()
        data = entry.weights.data.to(dev, non_blocking=True)
        t1 = time.perf_counter()
        if path == "table":
            streams = pack_table(entry, range(LLAMA3.num_hidden_layers), data)
        else:
            streams = pack_layers(layout, entry.placement,
                                  entry.layer_weights(range(LLAMA3.num_hidden_layers), data),
                                  entry.scaling, torch.bfloat16)
        t2 = time.perf_counter()
        pool.load(slot, slot + 1, entry.placement, ids, streams)
        t3 = time.perf_counter()
        return {"copy_ms": (t1 - t0) * 1e3, "pack_ms": (t2 - t1) * 1e3,
                "write_ms": (t3 - t2) * 1e3, "total_ms": (t3 - t0) * 1e3}

    for e in entries.values():  # every kernel launched once (CUDA's lazy loading)
        for path in paths:
            load(e, 0, path)
    torch.cuda.synchronize()
    filler = []  # held to the end
    if a.free_gb:
        free, _ = torch.cuda.mem_get_info()
        filler.append(torch.empty(max(0, free - int(a.free_gb * 2**30)), dtype=torch.uint8,
                                  device=dev))
    files = [make_adapter(a.root, r, 100 + r) for r in ranks]  # the readers' own
    stop = threading.Event()

    largest = max_file_bytes(LLAMA3, max(ranks))
    readers_max = max(int(n) for n in a.readers.split(","))
    # The readers' buffers: shared chunks, which reader processes map (--read-in).
    shared = SharedChunks(pinned=True)
    scratch = [shared(largest) for _ in range(readers_max)]

    def reader(i: int, parts: ThreadPoolExecutor, procs: ReaderProcesses | None) -> None:
        torch.set_num_threads(1)
        while not stop.is_set():
            for f in files:
                read_weights(f, lambda n: scratch[i][:n], torch.finfo(torch.bfloat16).max,
                             parts=parts, files=procs)

    results = []
    syncs: dict[str, int] = {}
    conditions = [(float(b), int(n), int(sw), where) for b in a.busy_ms.split(",")
                  for n in a.readers.split(",") for sw in a.switch_us.split(",")
                  for where in a.read_in.split(",") if int(n) or where == "threads"]
    for busy, readers, switch_us, read_in in conditions:
        sys.setswitchinterval(switch_us * 1e-6 if switch_us else DEFAULT_SWITCH)
        parts = ThreadPoolExecutor(max(readers, 1), initializer=torch.set_num_threads,
                                   initargs=(1,))
        procs = (ReaderProcesses(shared.segments, readers) if read_in == "processes"
                 else None)
        threads = [threading.Thread(target=reader, args=(i, parts, procs), daemon=True)
                   for i in range(readers)]
        stop.clear()
        for t in threads:
            t.start()
        time.sleep(0.5 if readers else 0)
        for r, e in entries.items():
            for rep in range(a.reps):
                for path in paths:
                    torch.cuda.synchronize()
                    if busy:
                        torch.cuda._sleep(int(busy * cycles_per_ms))
                    torch.cuda.set_sync_debug_mode("warn")
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        row = load(e, 1 + rep % 3, path)
                    torch.cuda.set_sync_debug_mode("default")
                    for w in caught:
                        key = f"{path}: {os.path.basename(w.filename)}:{w.lineno}: {w.message}"
                        syncs[key[:240]] = syncs.get(key[:240], 0) + 1
                    row.update(path=path, rank=r, busy_ms=busy, readers=readers,
                               read_in=read_in, switch_us=switch_us, rep=rep,
                               bytes=e.weights.data.numel())
                    results.append(row)
                    print(json.dumps(row))
        stop.set()
        for t in threads:
            t.join()
        parts.shutdown()
        if procs is not None:
            procs.close()
    torch.cuda.synchronize()
    # The first synchronizing torch call of a load, with its stack.
    torch.cuda._sleep(int(50 * cycles_per_ms))
    torch.cuda.set_sync_debug_mode("error")
    first_sync = None
    try:
        load(entries[ranks[-1]], 1)
    except RuntimeError:
        first_sync = traceback.format_exc(limit=-8)
        print(first_sync, file=sys.stderr)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "free_gb": a.free_gb, "alloc_retries": stats.get("num_alloc_retries"),
           "syncs_all_streams": stats.get("num_sync_all_streams"),
           "device_frees": stats.get("num_device_free"),
           "cycles_per_ms": cycles_per_ms, "sync_warnings": syncs, "first_sync": first_sync,
           "loads": results}
    json.dump(out, open(a.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("loads", "first_sync")}))
    for (busy, readers, switch_us, read_in), path in itertools.product(conditions, paths):
        rows = [r for r in results if (r["busy_ms"], r["readers"], r["switch_us"],
                                       r["read_in"], r["path"])
                == (busy, readers, switch_us, read_in, path)]
        print(f"{path}: busy {busy:5.0f} ms, {readers} readers in {read_in}, switch "
              f"{switch_us or 'default'} us: host ms a load, median: " + ", ".join(
                  f"{k} {sorted(r[k] for r in rows)[len(rows) // 2]:.2f}"
                  for k in ("copy_ms", "pack_ms", "write_ms", "total_ms")))


if __name__ == "__main__":
    main()
