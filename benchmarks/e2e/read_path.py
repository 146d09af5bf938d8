"""Where the pool's disk -> host-tier read time goes, on this machine.

Two read paths for adapters of the e2e benchmark's shape (Llama-2-7B,
q/k/v/o, ranks 8..128, bf16), with 1, 4 and 8 reader threads (one intra-op
thread each), new pinned allocations and reused ones:
- `raw` (what the worker does, worker/paged_manager.py `_read_file`): the
  weights file's data into one (pinned) buffer with one `readinto`
  (adapters/peft.py `read_weights`); the packing runs on the device at load;
- `host-pack` (the previous read, for comparison): `load_adapter`, then
  every layer packed into page layout on the host (`pack_layer`: A copied,
  B transposed and scaled).
On a CUDA machine it also times the device side of loading `raw` entries:
one host-to-device copy, then the packing on the GPU, layer by layer
(`pack_layer`) and all layers at once (`pack_layers`, the worker's), and
the page writes of a load with each kernel backend's `page_writer` (torch:
one `index_copy_` per layer; triton: one launch for all layers, the GPU
worker's).

    python benchmarks/e2e/read_path.py --out read_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_loraserve.adapters.peft import load_adapter, read_weights, short_name, write_adapter
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer, pack_layers

H, LAYERS, PAGE, RANKS = 4096, 32, 2 * 16 * 32 * 128, (8, 16, 32, 64, 128)
SLICES = tuple(SliceSpec(n, H, H) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
LAYOUT = LayerLayout(SLICES, PAGE)


def make(root: str, n: int) -> list[str]:
    paths = []
    for i in range(n):
        r = RANKS[i % len(RANKS)]
        d = os.path.join(root, f"a{i:03d}")
        if not os.path.exists(os.path.join(d, "adapter_config.json")):
            g = torch.Generator().manual_seed(i)
            weights = {f"model.layers.{la}.self_attn.{m}": (
                torch.randn(r, H, generator=g).bfloat16(),
                torch.randn(H, r, generator=g).bfloat16())
                for la in range(LAYERS) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
            write_adapter(d, weights, rank=r, alpha=2 * r, base_model="x")
        paths.append(d)
    return paths


def read_pack(path: str, pin: bool) -> dict:
    t0 = time.perf_counter()
    spec, weights = load_adapter(path)
    t1 = time.perf_counter()
    placement = LAYOUT.place(spec.rank, spec.target_modules)
    streams = torch.empty((LAYERS, placement.num_pages * PAGE), dtype=torch.bfloat16,
                          pin_memory=pin)
    t2 = time.perf_counter()
    for layer, w in enumerate(per_layer(weights)):
        pack_layer(LAYOUT, placement, w, spec.scaling, torch.bfloat16, out=streams[layer])
    t3 = time.perf_counter()
    return dict(mb=streams.numel() * 2 / 1e6, load=t1 - t0, alloc=t2 - t1, copy=t3 - t2,
                total=t3 - t0, entry=streams)


def read_raw(path: str, pin: bool) -> dict:
    times = {}

    def alloc(n):
        t = time.perf_counter()
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        times["alloc"] = time.perf_counter() - t
        return buf

    t0 = time.perf_counter()
    spec, raw = read_weights(path, alloc)
    total = time.perf_counter() - t0
    return dict(mb=raw.data.numel() / 1e6, load=0.0, alloc=times["alloc"],
                copy=total - times["alloc"], total=total, entry=(spec, raw))


def per_layer(weights) -> list[dict]:
    out = [{} for _ in range(LAYERS)]
    for name, ab in weights.items():
        out[int(name.split(".")[2])][short_name(name)] = ab
    return out


def device_pack(entries) -> dict:
    """The device side of loading `raw` entries: the H2D copy, then the
    packing on the GPU, two ways: layer by layer (`pack_layer`, the launch
    pattern of the previous load) and all layers at once (`pack_layers`, what
    the worker does). `host_ms`: the host's time to issue it all (a step waits
    for that); `wall_ms`: until the GPU is done."""
    out = {}
    mb = sum(raw.data.numel() for _, raw in entries) / 1e6
    for how in ("per-layer", "all-layers", "per-layer", "all-layers"):  # second pass warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        for spec, raw in entries:
            data = raw.data.to("cuda", non_blocking=True)
            placement = LAYOUT.place(spec.rank, spec.target_modules)
            layers = per_layer(raw.tensors(data))
            if how == "all-layers":
                pack_layers(LAYOUT, placement, layers, spec.scaling, torch.bfloat16)
                continue
            streams = torch.empty((LAYERS, placement.num_pages * PAGE), dtype=torch.bfloat16,
                                  device="cuda")
            for layer, w in enumerate(layers):
                pack_layer(LAYOUT, placement, w, spec.scaling, torch.bfloat16,
                           out=streams[layer])
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        out[how] = dict(adapters=len(entries),
                        host_ms=round(1e3 * host / len(entries), 2),
                        wall_ms=round(1e3 * wall / len(entries), 2),
                        gb_per_s=round(mb / 1e3 / wall, 2))
    return out


def device_write(entries, blocks: int = 256) -> dict:
    """A load's page writes into 32 KV-shaped layers, per backend's
    `page_writer`, from streams already packed on the GPU; `host_ms` and
    `wall_ms` as in `device_pack`."""
    from vllm_loraserve.kernels import get_backend

    kv = [torch.zeros(blocks, PAGE, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    loads = []
    for spec, raw in entries:
        placement = LAYOUT.place(spec.rank, spec.target_modules)
        streams = pack_layers(LAYOUT, placement, per_layer(raw.tensors(raw.data.to("cuda"))),
                              spec.scaling, torch.bfloat16)
        ids = torch.randperm(blocks)[:placement.num_pages].int().cuda()
        loads.append((ids, streams))
    mb = sum(s.numel() * s.element_size() for _, s in loads) / 1e6
    out = {}
    for backend in ("torch", "triton", "torch", "triton"):  # second pass warm
        write = get_backend(backend).page_writer(kv)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for ids, streams in loads:
            write(ids, streams)
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        out[backend] = dict(loads=len(loads), host_ms=round(1e3 * host / len(loads), 3),
                            wall_ms=round(1e3 * wall / len(loads), 3),
                            gb_per_s=round(mb / 1e3 / wall, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/dev/shm/loraserve-read-path")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    pin = torch.cuda.is_available()
    paths = make(a.root, a.n)
    runs, device = [], None
    for path_kind, read in (("raw", read_raw), ("host-pack", read_pack)):
        for threads in (1, 4, 8):
            for blocks in ("new", "reused"):
                if blocks == "new" and pin:
                    torch._C._host_emptyCache()  # no cached pinned block to reuse
                t = time.perf_counter()
                # One intra-op thread per reader, as the worker's readers.
                with ThreadPoolExecutor(threads, initializer=torch.set_num_threads,
                                        initargs=(1,)) as ex:
                    # Entries stay alive to the end of the pass, as in a filling
                    # tier; then their blocks go back to torch's cache for "reused".
                    rows = list(ex.map(read, paths, [pin] * len(paths)))
                wall = time.perf_counter() - t
                if path_kind == "raw" and pin and device is None:
                    device = device_pack([r["entry"] for r in rows])
                    device["page_write"] = device_write([r["entry"] for r in rows])
                    print({"device_pack": device}, flush=True)
                for r in rows:
                    del r["entry"]
                run = dict(path=path_kind, threads=threads, blocks=blocks,
                           wall_s=round(wall, 2), reads=len(rows),
                           gb_per_s=round(sum(r["mb"] for r in rows) / 1e3 / wall, 2),
                           **{k: round(sum(r[k] for r in rows) / len(rows), 4)
                              for k in ("load", "alloc", "copy", "total")})
                print(run, flush=True)
                runs.append(run)
    json.dump({"pinned": pin, "cpus": os.cpu_count(), "torch": torch.__version__,
               "device_pack": device, "runs": runs}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
