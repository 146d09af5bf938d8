"""Paged heterogeneous-rank LoRA kernels vs vLLM's lora_shrink/lora_expand.

Both systems run in this process, on the same inputs, one transformer layer of
Llama-2-7B shapes (qkv, o, gate_up, down; hidden 4096, intermediate 11008),
bf16 weights and activations, scaling folded into B (as vLLM does):

- ours: weights at each adapter's true rank in shuffled 256 KiB pages (one KV
  block of one layer: 2 x 16 tokens x 32 heads x 128 dims x 2 B);
- vLLM: `max_loras` = adapters in the batch, every slot padded to the mix's
  maximum rank (as vLLM stores them for a server holding that mix), called as
  `PunicaWrapperGPU.add_lora_linear` does (shrink into an fp32 buffer, then
  expand with add_inputs), default `specialize_active_lora=False`.

Batches: decode T tokens, each its own request, adapters round-robin over
min(T, 32) adapters; prefill T tokens in min(32, T/64) equal requests. Adapter
i's rank: homogeneous `rN`; `uniform` = (8, 16, 32, 64, 128)[i % 5];
`skewed` = 128 if i % 10 == 9 else 8 (90 % rank 8, 10 % rank 128).

Time: each system's shrink+expand of one module is captured in a CUDA graph
(vLLM replays decode steps from graphs; eager launches would measure Python
launch overhead, not kernels), L times over L distinct copies of the weights,
like L layers of a model (L = enough copies for ~512 MB of weights, at most
16), so the graph's launch latency is amortized and no copy finds another's
weights in L2; median of triton.testing.do_bench over replays (CUDA events,
L2 flushed before each replay) divided by L. The layer is the sum of its four
modules. Bytes: what the work
needs at the adapters' true ranks (A and B once per adapter, x once, y read
and written), the same figure for both systems. Peak bandwidth: a 2 GiB
device-to-device copy measured in this run.

    python benchmarks/kernels/bench_lora_kernels.py --out results.json [--tune]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import time

import torch
import triton

from vllm_loraserve.kernels import make_batch
from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable, TokenBatch
from vllm_loraserve.kernels.triton_mbgmm import Tiles, TritonBackend, expand_tiles, shrink_tiles
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer, write_pages

# --shape: (hidden, intermediate, k/v heads); 32 query heads of 128 dims each.
SHAPES = {"llama2-7b": (4096, 11008, 32), "llama3-8b": (4096, 14336, 8)}


def slices(hidden: int, inter: int, kv_heads: int) -> tuple[SliceSpec, ...]:
    kv = kv_heads * 128
    return (SliceSpec("q_proj", hidden, hidden), SliceSpec("k_proj", hidden, kv),
            SliceSpec("v_proj", hidden, kv), SliceSpec("o_proj", hidden, hidden),
            SliceSpec("gate_proj", hidden, inter), SliceSpec("up_proj", hidden, inter),
            SliceSpec("down_proj", inter, hidden))


HIDDEN, INTER, KV_HEADS = SHAPES["llama2-7b"]  # main() rebinds these for --shape
SLICES = slices(HIDDEN, INTER, KV_HEADS)
MODULES = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"],
           "gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"]}
PAGE_SIZE = 2 * 16 * KV_HEADS * 128  # elements: one KV block of one layer
DECODE_T, PREFILL_T = (1, 8, 32, 128, 256), (512, 2048, 8192)
MIXES = ("r8", "r16", "r32", "r64", "r128", "uniform", "skewed")
DTYPE = torch.bfloat16


def adapter_ranks(mix: str, n: int) -> list[int]:
    if mix.startswith("r"):
        return [int(mix[1:])] * n
    if mix == "uniform":
        return [(8, 16, 32, 64, 128)[i % 5] for i in range(n)]
    return [128 if i % 10 == 9 else 8 for i in range(n)]


def mix_max_rank(mix: str) -> int:
    return int(mix[1:]) if mix.startswith("r") else 128


def batch_shape(t: int) -> tuple[int, list[int]]:
    """(number of adapters, adapter index of each token)."""
    if t in DECODE_T:
        n = min(t, 32)
        return n, [i % n for i in range(t)]
    n = min(32, t // 64)
    return n, [i * n // t for i in range(t)]


class Case:
    def __init__(self, t: int, mix: str, seed: int = 0, device: str = "cuda"):
        self.t, self.mix = t, mix
        self.n, self.token_adapter = batch_shape(t)
        self.ranks = adapter_ranks(mix, self.n)
        self.max_rank = mix_max_rank(mix)
        self.device = dev = device
        g = torch.Generator(device=dev).manual_seed(seed)
        self.layout = LayerLayout(SLICES, page_size=PAGE_SIZE, align=256)
        names = [s.name for s in SLICES]
        placements = [self.layout.place(r, names) for r in self.ranks]
        total = sum(p.num_pages for p in placements)
        self.pool = torch.zeros(total, PAGE_SIZE, dtype=DTYPE, device=dev)
        free = list(range(total))
        random.Random(seed).shuffle(free)
        self.vllm_a = {s.name: torch.zeros(self.n, self.max_rank, s.in_features, dtype=DTYPE,
                                           device=dev) for s in SLICES}
        self.vllm_b = {s.name: torch.zeros(self.n, s.out_features, self.max_rank, dtype=DTYPE,
                                           device=dev) for s in SLICES}
        entries = []
        for i, (r, p) in enumerate(zip(self.ranks, placements, strict=True)):
            weights = {}
            for s in SLICES:
                a = torch.randn(r, s.in_features, generator=g, device=dev) / math.sqrt(
                    s.in_features)
                b = torch.randn(s.out_features, r, generator=g, device=dev) / math.sqrt(r)
                weights[s.name] = (a, b)
                self.vllm_a[s.name][i, :r] = a.to(DTYPE)
                self.vllm_b[s.name][i, :, :r] = b.to(DTYPE)
            ids = [free.pop() for _ in range(p.num_pages)]
            write_pages(self.pool, ids, pack_layer(self.layout, p, weights, 1.0, DTYPE),
                        PAGE_SIZE)
            entries.append((p, ids))
        self.slots = SlotTable.build(self.layout, entries, self.max_rank, dev)
        padded = sum(w.numel() * 2 for w in (*self.vllm_a.values(), *self.vllm_b.values()))
        self.copies = max(1, min(16, (512 << 20) // padded))
        self.pools = [self.pool] + [self.pool.clone() for _ in range(self.copies - 1)]
        self.vllm_copies = [(self.vllm_a, self.vllm_b)] + [
            ({k: v.clone() for k, v in self.vllm_a.items()},
             {k: v.clone() for k, v in self.vllm_b.items()}) for _ in range(self.copies - 1)]
        self.batch = make_batch(self.token_adapter, dev)
        self.x = {k: torch.randn(t, ModuleSlices.of(self.layout, v).in_features, generator=g,
                                 device=dev).to(DTYPE) for k, v in MODULES.items()}
        self.y0 = {k: torch.randn(t, sum(ModuleSlices.of(self.layout, v).out_features),
                                  generator=g, device=dev).to(DTYPE)
                   for k, v in MODULES.items()}
        self._vllm_meta()

    def _vllm_meta(self) -> None:
        from vllm.lora.ops.triton_ops import utils
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        # vLLM caches weight pointers and strides by data_ptr (its weights live
        # for the engine's lifetime); ours are freed per case and the addresses
        # come back with other shapes, so start from empty caches.
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()
        self.meta = LoRAKernelMeta.make(self.n, self.t, self.device)
        self.meta.prepare_tensors(torch.tensor(self.token_adapter, dtype=torch.int32,
                                               device=self.device))

    def bytes_needed(self, module: str) -> int:
        m = ModuleSlices.of(self.layout, MODULES[module])
        weights = sum(r * (m.in_features * m.count + sum(m.out_features)) for r in self.ranks)
        return 2 * (weights + self.t * m.in_features + 2 * self.t * sum(m.out_features))

    def ours(self, backend: TritonBackend, module: str, copy: int = 0):
        m = ModuleSlices.of(self.layout, MODULES[module])
        h = torch.empty(m.count, self.t, self.max_rank, dtype=torch.float32, device=self.device)
        x, y, pool = self.x[module], self.y0[module].clone(), self.pools[copy]

        def run():
            backend.shrink(x, pool, h, self.batch, self.slots, m, self.layout)
            backend.expand(h, pool, y, self.batch, self.slots, m, self.layout)
        return run, y

    def vllm(self, module: str, copy: int = 0):
        from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

        names = MODULES[module]
        a_all, b_all = self.vllm_copies[copy]
        a = [a_all[n] for n in names]
        b = [b_all[n] for n in names]
        buf = torch.empty(len(names), self.t, self.max_rank, dtype=torch.float32,
                          device=self.device)
        x, y = self.x[module], self.y0[module].clone()
        args = self.meta.meta_args(self.t, False)

        def run():
            lora_shrink(x, a, buf, *args, 1.0)
            lora_expand(buf, b, y, *args, offset_start=0, add_inputs=True)
        return run, y


def peak_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200,
                                 return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def bench(fns: list, rep: int = 100) -> float:
    """Median microseconds per call of `fns` (one per weight copy), all
    captured in one CUDA graph; L2 flushed before each replay by do_bench."""
    for fn in fns:
        fn()  # compile and fill caches outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fns[0]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=rep, return_mode="median")
    return ms * 1e3 / len(fns)


def layer_time(case: Case, backend: TritonBackend, rep: int) -> float:
    return sum(bench([case.ours(backend, m, c)[0] for c in range(case.copies)], rep)
               for m in MODULES)


def tune(log) -> dict:
    """Pick our tile sizes per phase on one representative case each."""
    chosen = {}
    probes = {"decode": Case(256, "uniform", seed=1), "prefill": Case(2048, "uniform", seed=1)}
    grids = {
        ("decode", "shrink"): [Tiles(bn, bk, sk, 4, st) for bn, bk, sk, st in
                               itertools.product((16, 32), (128, 256), (0, 16), (2, 4))],
        ("prefill", "shrink"): [Tiles(bn, bk, sk, w, st) for bn, bk, sk, w, st in
                                itertools.product((16, 32), (64, 128), (0, 1), (4, 8), (3,))],
        ("decode", "expand"): [Tiles(bn, bk, 1, 4, st) for bn, bk, st in
                               itertools.product((64, 128, 256), (16, 32), (2, 4))],
        ("prefill", "expand"): [Tiles(bn, bk, 1, w, st) for bn, bk, w, st in
                                itertools.product((64, 128), (16, 32), (4, 8), (2, 3))],
    }
    for (phase, op), candidates in grids.items():
        case, best = probes[phase], None
        log(f"tuning {phase} {op} over {len(candidates)} candidates")
        for tiles in candidates:
            if op == "shrink":
                backend = TritonBackend(shrink_tiles=lambda b, k, t=tiles: t)
            else:
                backend = TritonBackend(expand_tiles=lambda b, t=tiles: t)
            try:
                us = layer_time(case, backend, rep=40)
            except Exception as e:  # a tile that does not compile or fit is skipped
                log(f"  {phase} {op} {tiles}: failed ({type(e).__name__})")
                continue
            log(f"  {phase} {op} {tiles}: {us:.1f} us")
            if best is None or us < best[0]:
                best = (us, tiles)
        chosen[f"{phase}/{op}"] = best[1].__dict__
        log(f"{phase} {op}: best {best[1]} ({best[0]:.1f} us)")
    return chosen


def default_tiles() -> dict:
    """What the built-in heuristics pick for each phase (recorded with results)."""
    out = {}
    for phase, bm in (("decode", 16), ("prefill", 64)):
        probe = TokenBatch.build([], bm)
        out[f"{phase}/shrink"] = shrink_tiles(probe, HIDDEN).__dict__
        out[f"{phase}/expand"] = expand_tiles(probe).__dict__
    return out


def backend_from(chosen: dict | None) -> TritonBackend:
    if not chosen:
        return TritonBackend()
    pick = {k: Tiles(**v) for k, v in chosen.items()}
    return TritonBackend(
        shrink_tiles=lambda b, k: pick["decode/shrink" if b.block_m <= 16 else "prefill/shrink"],
        expand_tiles=lambda b: pick["decode/expand" if b.block_m <= 16 else "prefill/expand"])


def compare(case: Case, backend: TritonBackend, module: str) -> tuple[float, float]:
    """Run both systems once from the same y; (max |ours - vLLM|, max |delta|).
    Raises if they disagree beyond bf16 rounding."""
    run_o, y_o = case.ours(backend, module)
    run_v, y_v = case.vllm(module)
    run_o()
    run_v()
    torch.cuda.synchronize()
    delta = (y_v.float() - case.y0[module].float()).abs().max().item()
    err = (y_o.float() - y_v.float()).abs().max().item()
    if not err <= 2e-2 * max(1.0, delta):
        raise AssertionError(f"T={case.t} {case.mix} {module}: ours and vLLM differ by {err} "
                             f"(delta magnitude {delta})")
    return err, delta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tune", action="store_true", help="pick our tile sizes first")
    p.add_argument("--tiles", help="tile sizes: a results JSON of an earlier --tune run")
    p.add_argument("--tokens", type=int, nargs="*", default=[*DECODE_T, *PREFILL_T])
    p.add_argument("--mixes", nargs="*", default=list(MIXES))
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b",
                   help="layer shapes (llama3-8b: GQA k/v out 1024, intermediate 14336, and "
                        "its smaller KV pages)")
    a = p.parse_args()
    global HIDDEN, INTER, KV_HEADS, SLICES, PAGE_SIZE
    HIDDEN, INTER, KV_HEADS = SHAPES[a.shape]
    SLICES, PAGE_SIZE = slices(HIDDEN, INTER, KV_HEADS), 2 * 16 * KV_HEADS * 128

    def log(*msg):
        print(*msg, flush=True)

    import vllm

    t0 = time.time()
    peak = peak_bandwidth()
    log(f"{torch.cuda.get_device_name()}: measured copy bandwidth {peak / 1e12:.2f} TB/s")
    smoke = Case(8, "uniform", seed=2)  # fail fast, before any tuning
    for module in MODULES:
        compare(smoke, TritonBackend(), module)
    del smoke
    if a.tune:
        chosen = tune(log)
    elif a.tiles:
        saved = json.load(open(a.tiles))
        chosen = saved.get("tiles", saved)  # a results file or a bare tiles dict
    else:
        chosen = None
    ours_backend = backend_from(chosen)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "vllm": vllm.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "peak_copy_bytes_per_s": peak, "shape": a.shape,
        "tiles": chosen or default_tiles(), "tuned": bool(a.tune), "rows": [],
    }
    rows = result["rows"]
    for t, mix in itertools.product(a.tokens, a.mixes):
        case = Case(t, mix)
        for module in MODULES:
            err, delta = compare(case, ours_backend, module)
            us_o = bench([case.ours(ours_backend, module, c)[0] for c in range(case.copies)])
            us_v = bench([case.vllm(module, c)[0] for c in range(case.copies)])
            nbytes = case.bytes_needed(module)
            rows.append({
                "phase": "decode" if t in DECODE_T else "prefill", "tokens": t, "mix": mix,
                "adapters": case.n, "copies": case.copies, "module": module,
                "ours_us": us_o, "vllm_us": us_v,
                "speedup": us_v / us_o, "bytes": nbytes,
                "ours_bw_pct": 100 * nbytes / (us_o * 1e-6) / peak,
                "vllm_bw_pct": 100 * nbytes / (us_v * 1e-6) / peak,
                "max_abs_diff": err, "delta_max": delta,
            })
        layer = [r for r in rows if r["tokens"] == t and r["mix"] == mix]
        o, v = sum(r["ours_us"] for r in layer), sum(r["vllm_us"] for r in layer)
        nb = sum(r["bytes"] for r in layer)
        log(f"T={t:5d} {mix:8s} n={case.n:2d} ours {o:9.1f} us  vLLM {v:9.1f} us  "
            f"x{v / o:5.2f}  ours {100 * nb / (o * 1e-6) / peak:5.1f}% of peak BW")
        result["wall_s"] = time.time() - t0
        json.dump(result, open(a.out, "w"), indent=1)  # after every case: partial runs count
        del case
        torch.cuda.empty_cache()
    log(f"wrote {a.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
