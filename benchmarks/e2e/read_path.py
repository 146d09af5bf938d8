"""Where the pool's disk -> host-tier read time goes, on this machine.

Each read (worker/paged_manager.py `_pack`) is: parse the safetensors file
(`load_adapter`), allocate the entry's buffer (pinned on a CUDA machine:
torch's caching host allocator, which rounds to a power of two and caches
freed blocks), and pack every layer into page layout (`pack_layer`: A copied,
B transposed and scaled). This times the three parts apart for adapters of
the e2e benchmark's shape (Llama-2-7B, q/k/v/o, ranks 8..128, bf16) with 1,
4 and 8 reader threads, new allocations and reused ones.

    python benchmarks/e2e/read_path.py --out read_path.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_loraserve.adapters.peft import load_adapter, short_name, write_adapter
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer

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


def read(path: str, pin: bool) -> tuple[dict, torch.Tensor]:
    t0 = time.perf_counter()
    spec, weights = load_adapter(path)
    t1 = time.perf_counter()
    placement = LAYOUT.place(spec.rank, spec.target_modules)
    streams = torch.empty((LAYERS, placement.num_pages * PAGE), dtype=torch.bfloat16,
                          pin_memory=pin)
    t2 = time.perf_counter()
    per_layer = [{} for _ in range(LAYERS)]
    for name, ab in weights.items():
        per_layer[int(name.split(".")[2])][short_name(name)] = ab
    for layer, w in enumerate(per_layer):
        pack_layer(LAYOUT, placement, w, spec.scaling, torch.bfloat16, out=streams[layer])
    t3 = time.perf_counter()
    return dict(rank=spec.rank, mb=streams.numel() * 2 / 1e6, load=t1 - t0, alloc=t2 - t1,
                pack=t3 - t2, total=t3 - t0), streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/dev/shm/loraserve-read-path")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    pin = torch.cuda.is_available()
    paths = make(a.root, a.n)
    runs = []
    for threads, intra in ((1, 0), (4, 0), (8, 0), (4, 1), (8, 1), (8, 2)):
        for alloc in ("new", "reused"):
            if alloc == "new" and pin:
                torch._C._host_emptyCache()  # no cached pinned block to reuse
            t = time.perf_counter()
            # intra: torch's intra-op threads in each reader (0: torch's default;
            # per reader thread, as OpenMP's thread count is per calling thread).
            init = functools.partial(torch.set_num_threads, intra) if intra else None
            with ThreadPoolExecutor(threads, initializer=init) as ex:
                # Entries stay alive to the end of the pass, as in a filling tier;
                # then their blocks go back to torch's cache for the "reused" pass.
                results = list(ex.map(lambda p: read(p, pin), paths))
            wall = time.perf_counter() - t
            rows = [r for r, _ in results]
            del results
            run = dict(threads=threads, intra_op=intra or torch.get_num_threads(), blocks=alloc,
                       wall_s=round(wall, 2), reads=len(rows),
                       gb_per_s=round(sum(r["mb"] for r in rows) / 1e3 / wall, 2),
                       **{k: round(sum(r[k] for r in rows) / len(rows), 4)
                          for k in ("load", "alloc", "pack", "total")})
            print(run, flush=True)
            runs.append(run)
    json.dump({"pinned": pin, "cpus": os.cpu_count(), "torch": torch.__version__,
               "runs": runs}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
