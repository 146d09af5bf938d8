"""The paged kernels as the engine launches them, per module kind, at the
shapes users run; A/B against a baseline kernel module, and a tile sweep.

`bench_lora_kernels.py` sizes each launch to the batch's real work blocks.
The engine cannot: its batches are replayed from CUDA graphs, so a launch is
sized for the most work blocks a batch of that many tokens can have
(worker/pool.py `DevicePool._batch`). This runs the engine's own path
(`DevicePool`: slot table of 4096 slots, persistent token batches,
`add_lora`, one CUDA graph per module kind over `LAYERS` layers) and reports
microseconds per layer, the distinct adapters' bytes the step must read, and
the bandwidth that makes against a device-to-device copy timed in the same
process.

    git show REV:src/vllm_loraserve/kernels/triton_mbgmm.py > /tmp/old_mbgmm.py
    python benchmarks/kernels/engine_grid.py --shape llama3-8b --targets all-linear \\
        --baseline /tmp/old_mbgmm.py --out r.json
    python benchmarks/kernels/engine_grid.py --shape llama3-8b --targets all-linear \\
        --sweep --out sweep.json     # coordinate search over tiles, per module kind
    python benchmarks/kernels/engine_grid.py --shape llama3-8b --targets all-linear \\
        --mixes pow-200 --tokens 1024 --sweep --tiles-out tiles.json --out sweep.json
        # its picks as a table for `vllm serve ... --loraserve-tiles tiles.json`;
        # `--tiles tiles.json` times a table beside the rules
    python benchmarks/kernels/engine_grid.py --shape llama3-8b --targets all-linear \\
        --tokens 1024,2048 --prefill-chunks 2 --rules split,all64,all16 --out rules.json

`--block-orders rank,slot` times the current kernels with the step's work
blocks by decreasing rank (kernels/batch.py BLOCK_ORDER, the default) and in
slot order (before session 38), in one process.

`--prefill-chunks N` puts N prefill chunks of `--chunk-tokens` tokens, each
of one adapter, in every step beside its power-law decode tokens, as an
engine step with chunked prefill holds them. `--rules` times the current
kernels under each way the pool cuts inputs above SMALL_BATCH rows into
work blocks (worker/pool.py LARGE_RULES).

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys

import numpy as np
import torch
import triton

from vllm_loraserve.kernels import batch as batch_mod
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.tile_table import TileTable, batch_class, check_tiles
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer
from vllm_loraserve.worker.pool import DevicePool

LAYERS = 8
SLOTS = 4096  # the pool's slot table
# page: one layer's KV block of 16 tokens (K and V, kv heads x head 128), bf16.
SHAPES = {
    "llama2-7b": dict(hidden=4096, kv=4096, inter=11008, page=2 * 16 * 32 * 128,
                      ranks=(8, 16, 32, 64, 128)),
    "llama3-8b": dict(hidden=4096, kv=1024, inter=14336, page=2 * 16 * 8 * 128,
                      ranks=(16, 32, 64)),
}
MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
           "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
TARGETS = {"qkvo": ("qkv", "o"), "all-linear": tuple(MODULES)}
# Adapters in the pool; tokens pick them by a power law (alpha 1), as the e2e
# workload does (pow-400 puts ~170 distinct adapters in 512 tokens).
MIXES = {"single-r8": 1, "single-r64": 1, "pow-32": 32, "pow-100": 100, "pow-200": 200,
         "pow-400": 400}
TOKENS = (1, 16, 64, 256, 512, 2048, 8192)


def slices_of(shape: dict, kinds: tuple[str, ...]) -> tuple[SliceSpec, ...]:
    h, kv, inter = shape["hidden"], shape["kv"], shape["inter"]
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return tuple(SliceSpec(n, *dims[n]) for k in kinds for n in MODULES[k])


def build(shape: dict, kinds: tuple[str, ...], mix: str, tokens: int, dev: torch.device,
          rule: str = "split", chunks: int = 0, chunk_tokens: int = 256,
          layer_gb: float = 0.0, order: str | None = None) -> tuple[DevicePool, int, int]:
    """A bound pool holding the mix's adapters, its step set to `tokens`
    tokens (`chunks` of them prefill chunks of `chunk_tokens` tokens), its
    work blocks in `order` (kernels/batch.py BLOCK_ORDER; None: as set); the
    bytes of A and B (all layers) of the step's distinct adapters (what its
    kernels must read at least once); their number. `layer_gb`: each layer's
    page tensor at least this large, the adapters' pages scattered over it
    (as over a KV cache that fills the GPU); 0: just large enough."""
    slices = slices_of(shape, kinds)
    n = MIXES[mix]
    ranks = (int(mix.removeprefix("single-r")),) if mix.startswith("single-r") else shape["ranks"]
    max_rank = max(shape["ranks"])
    pool = DevicePool(slices, LAYERS, max_rank, tokens, SLOTS, 3, "triton", dev,
                      large_rule=rule)
    layout = LayerLayout(slices, shape["page"])
    names = [s.name for s in slices]
    placements = [layout.place(ranks[i % len(ranks)], names) for i in range(n)]
    total = max(sum(p.num_pages for p in placements) + 1,
                int(layer_gb * 1e9) // (2 * shape["page"]))
    pool.bind([torch.zeros(total, shape["page"], dtype=torch.bfloat16, device=dev)
               for _ in range(LAYERS)])
    free = list(range(1, total))
    random.Random(0).shuffle(free)
    g = torch.Generator(device=dev).manual_seed(0)
    for i, p in enumerate(placements):
        ids = tuple(free.pop() for _ in range(p.num_pages))
        # One layer's weights written to every layer: the bytes are what count.
        w = {s.name: (torch.randn(p.rank, s.in_features, generator=g, device=dev)
                      / s.in_features ** 0.5,
                      torch.randn(s.out_features, p.rank, generator=g, device=dev) * 0.05)
             for s in slices}
        stream = pack_layer(layout, p, w, 0.5, torch.bfloat16)
        pool.load(i, i + 1, p, ids, stream.expand(LAYERS, -1).contiguous())
    rng = np.random.default_rng(0)
    w = 1.0 / np.arange(1, n + 1)
    decode = tokens - chunks * chunk_tokens
    if decode < 0:
        raise SystemExit(f"{chunks} chunks of {chunk_tokens} tokens exceed {tokens} tokens")
    ids = rng.choice(np.arange(1, n + 1), size=decode, p=w / w.sum())
    # Each chunk's adapter drawn the same way; its tokens are consecutive rows.
    chunk_ids = rng.choice(np.arange(1, n + 1), size=chunks, p=w / w.sum())
    ids = np.concatenate([np.repeat(chunk_ids, chunk_tokens), ids]).astype(np.int64)
    if order is not None:
        batch_mod.BLOCK_ORDER = order  # the step's batches are filled here
    pool.set_tokens(ids, set())
    step_bytes = sum(layout.weight_elements(placements[i - 1]) for i in set(ids.tolist()))
    return pool, step_bytes * 2 * LAYERS, len(set(ids.tolist()))


def time_module(pool: DevicePool, kind: str, tokens: int, dev: torch.device,
                eager: bool = False) -> tuple[float, torch.Tensor]:
    """(microseconds per layer, layer 0's output from zero) of one module kind;
    `eager`: launched from Python each time, as vLLM runs a step larger than
    its largest CUDA graph (the host's launch cost counts where it exceeds
    the GPU's time)."""
    m = ModuleSlices.of(pool.layout, MODULES[kind])
    x = torch.randn(tokens, m.in_features, device=dev, dtype=torch.bfloat16,
                    generator=torch.Generator(device=dev).manual_seed(1))
    y = torch.zeros(tokens, sum(m.out_features), device=dev, dtype=torch.bfloat16)
    pool.add_lora(0, m, x, y)
    first = y.clone()

    def step():
        for layer in range(LAYERS):
            pool.add_lora(layer, m, x, y)
    step()
    if eager:
        ms = triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")
        return ms * 1e3 / LAYERS, first
    return graph_us(step) / LAYERS, first


def graph_us(fn) -> float:
    """Median microseconds of one replay of `fn` captured in a CUDA graph
    (warmed up first on a side stream, as torch's graph capture asks)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return ms * 1e3


def copy_tb_s(dev: torch.device) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50,
                                 return_mode="median")
    return 2 * src.numel() / ms / 1e9


def save(args: argparse.Namespace, peak: float, rows: list[dict], **extra) -> None:
    """A run's rows to `args.out`, under the device, versions, shape and
    targets, the layers per graph and the copy bandwidth of the process."""
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "shape": args.shape, "targets": args.targets,
                   **extra, "layers": LAYERS, "copy_tb_s": round(peak, 3), "rows": rows},
                  f, indent=1)


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# The sweep's candidates: a coordinate search over these, from the rules'
# picks: the stream-K shrink first (the pool's steps carry jobs), then the
# expand (with the best shrink). Candidates `check_tiles` refuses are skipped.
STREAM_AXES = dict(block_k=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4),
                   max_regs=(0, 32, 48, 64), programs_per_sm=(0, 4, 16))
EXPAND_AXES = dict(block_n=(32, 64, 128), block_k=(16, 32, 64),
                   num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4), max_regs=(0, 40, 48),
                   programs_per_sm=(0, 64, 128))


def probe_batch(pool, tokens):
    """The one batch the pool runs for `tokens` tokens, which the sweep times."""
    batches = pool._batches_for(tokens)
    if len(batches) != 1:
        raise SystemExit("the sweep times one batching: name one rule (--rules all16 or all64)")
    if batches[0].jobs is None:
        raise SystemExit("the sweep times the pool's path: its batches carry jobs")
    return batches[0]


def sweep(pool, kind, tokens, dev, mbgmm, log, table_rows: dict | None = None) -> dict:
    """Coordinate descent over each axis in turn, once, from the rules'
    tiles; the picks go into `table_rows` (a tile table's entries) if given.
    An expand whose key another kind's sweep already picked for (o_proj's
    and down_proj's are the same launch) keeps that pick."""
    probe = probe_batch(pool, tokens)
    m = ModuleSlices.of(pool.layout, MODULES[kind])
    keys = {op: TileTable.key(op, probe.max_blocks, probe.block_m, size, m.count)
            for op, size in (("stream", m.in_features), ("expand", max(m.out_features)))}
    best = {"stream": mbgmm.stream_tiles(probe, m.in_features),
            "expand": mbgmm.expand_tiles(probe, max(m.out_features))}
    swept = [op for op in best if table_rows is None or keys[op] not in table_rows]
    for op in best:
        if op not in swept:
            best[op] = table_rows[keys[op]]

    def run(tiles):
        pool.backend = mbgmm.TritonBackend(**{f"{op}_tiles": lambda b, size, t=t: t
                                              for op, t in tiles.items()})
        return time_module(pool, kind, tokens, dev)

    best_us, ref = run(best)
    axes_of = {"stream": STREAM_AXES, "expand": EXPAND_AXES}
    for op in swept:
        for axis, values in axes_of[op].items():
            for v in values:
                cand = dict(best)
                cand[op] = mbgmm.Tiles(**{**best[op].__dict__, axis: v})
                try:
                    check_tiles(op, cand[op])
                except ValueError:
                    continue
                if cand[op] == best[op]:
                    continue
                try:
                    us, y = run(cand)
                except Exception as e:  # e.g. out of shared memory: not a candidate
                    log(f"  {op} {axis}={v}: {type(e).__name__}")
                    continue
                err = (y.float() - ref.float()).abs().max().item()
                if err > 0.05 * max(1.0, ref.float().abs().max().item()):
                    raise AssertionError(f"{op} {cand[op]}: max diff {err}")
                if us < best_us:
                    best, best_us = cand, us
    if table_rows is not None:
        for op in swept:
            table_rows[keys[op]] = best[op]
    return dict(us=round(best_us, 2), swept=swept, **{op: t.__dict__ for op, t in best.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="qkvo")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--baseline", help="a triton_mbgmm.py to compare with")
    ap.add_argument("--sweep", action="store_true",
                    help="search tiles per module kind, mix and token count")
    ap.add_argument("--tiles-out",
                    help="with --sweep: write its picks as a tile table (--loraserve-tiles); "
                         "one mix, and one token count per batch class (kernels/"
                         "tile_table.py batch_class)")
    ap.add_argument("--tiles",
                    help="a tile table (--tiles-out, --loraserve-tiles) to time beside the "
                         "rules, under the first rule and block order")
    ap.add_argument("--rules", default="split",
                    help="comma-separated worker/pool.py LARGE_RULES to time the current "
                         "kernels under (inputs above SMALL_BATCH rows); the first one is "
                         "the sweep's and the baseline's")
    ap.add_argument("--block-orders", default="rank",
                    help="comma-separated kernels/batch.py BLOCK_ORDERs (rank, slot) to time "
                         "the current kernels under; the first one is the sweep's and the "
                         "baseline's")
    ap.add_argument("--small-batch", type=int,
                    help="worker/pool.py SMALL_BATCH for this run (0: every input follows "
                         "the rules), to time the rules at any token count")
    ap.add_argument("--tall", type=int,
                    help="worker/pool.py TALL for this run (the split rule's threshold)")
    ap.add_argument("--eager", action="store_true",
                    help="time eager launches instead of CUDA-graph replays")
    ap.add_argument("--prefill-chunks", type=int, default=0)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.tiles_out and (not a.sweep or "," in a.mixes):
        raise SystemExit("--tiles-out writes a sweep's picks: add --sweep, and name one mix")
    if a.tiles and a.sweep:
        raise SystemExit("--tiles times a table beside the rules; the sweep times its own")
    from vllm_loraserve.kernels import triton_mbgmm as mbgmm
    from vllm_loraserve.worker import pool as pool_mod

    dev = torch.device("cuda")
    shape, kinds = SHAPES[a.shape], TARGETS[a.targets]
    old = load_module(a.baseline, "baseline_mbgmm") if a.baseline else None
    if a.small_batch is not None:
        pool_mod.SMALL_BATCH = a.small_batch
    if a.tall is not None:
        pool_mod.TALL = a.tall
    rules = list(dict.fromkeys(a.rules.split(",")))
    orders = list(dict.fromkeys(a.block_orders.split(",")))
    unknown = set(rules) - set(pool_mod.LARGE_RULES)
    if unknown:
        raise SystemExit(f"unknown rules {sorted(unknown)}: {sorted(pool_mod.LARGE_RULES)}")
    if set(orders) - set(batch_mod.BLOCK_ORDERS):
        raise SystemExit(f"unknown block orders {orders}: {batch_mod.BLOCK_ORDERS}")
    # (name, backend, (rule, block order)): the baseline kernels under the
    # first of each, then the current kernels under every pair. (An A/B of the
    # orders is --block-orders rank,slot: --baseline's kernels get the first.)
    first = (rules[0], orders[0])
    variants = [("baseline", old.TritonBackend(), first)] if old is not None else []
    for rule in rules:
        for order in orders:
            name = "-".join(v for v, many in ((rule, len(rules) > 1), (order, len(orders) > 1))
                            if many) or "new"
            variants.append((name, mbgmm.TritonBackend(), (rule, order)))
    if a.tiles:
        variants.append(("table", mbgmm.TritonBackend(table=TileTable.load(a.tiles)), first))
    names = [name for name, _, _ in variants]
    rows, table_rows = [], {} if a.tiles_out else None
    if a.tiles_out:  # one token count per batch class (its picks are the class's): now
        classes = {}
        for t in (int(v) for v in a.tokens.split(",")):
            (key, bound), *more = pool_mod.plan(t, SLOTS, first[0])
            cls = batch_class(bound, key[1])
            if more:
                raise SystemExit(f"--tiles-out: {t} tokens make {1 + len(more)} batchings "
                                 f"under rule {first[0]!r}; the sweep times one")
            if cls in classes:
                raise SystemExit(f"--tiles-out: {t} and {classes[cls]} tokens are both batch "
                                 f"class {cls!r}: sweep one token count per class")
            classes[cls] = t
    peak = copy_tb_s(dev)
    print(f"copy: {peak:.2f} TB/s", flush=True)
    for mix in a.mixes.split(","):
        for t in (int(v) for v in a.tokens.split(",")):
            pools = {}
            keys = [first] if a.sweep else dict.fromkeys(key for _, _, key in variants)
            for rule, order in keys:
                pools[rule, order], step_bytes, distinct = build(
                    shape, kinds, mix, t, dev, rule, a.prefill_chunks, a.chunk_tokens,
                    order=order)
            row = dict(mix=mix, tokens=t, distinct=distinct, prefill_chunks=a.prefill_chunks,
                       chunk_tokens=a.chunk_tokens,
                       mb_per_layer=round(step_bytes / LAYERS / 1e6, 2))
            for kind in kinds:
                if a.sweep:
                    row[kind] = sweep(pools[first], kind, t, dev, mbgmm, print, table_rows)
                    continue
                ys = {}
                for name, backend, key in variants:
                    pools[key].backend = backend
                    batch_mod.BLOCK_ORDER = key[1]  # a batch filled while timing follows it
                    row[f"{kind}_{name}_us"], ys[name] = time_module(pools[key], kind, t, dev,
                                                                     a.eager)
                for name in names[1:]:
                    row[f"{kind}_{name}_max_abs_diff"] = (
                        ys[name].float() - ys[names[0]].float()).abs().max().item()
            per_kind = ({"sweep": [row[k]["us"] for k in kinds]} if a.sweep else
                        {name: [row[f"{k}_{name}_us"] for k in kinds] for name in names})
            for name, times in per_kind.items():
                us = sum(times)
                row[f"{name}_layer_us"] = round(us, 2)
                row[f"{name}_tb_s"] = round(step_bytes / LAYERS / us / 1e6, 3)
                row[f"{name}_pct_copy"] = round(100 * row[f"{name}_tb_s"] / peak, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del pools
            torch.cuda.empty_cache()
    save(a, peak, rows, rules=rules, block_orders=orders, eager=a.eager,
         small_batch=pool_mod.SMALL_BATCH, tall=pool_mod.TALL)
    if a.tiles_out:
        table = TileTable(torch.cuda.get_device_name(), triton.__version__, table_rows)
        with open(a.tiles_out, "w") as f:
            f.write(table.to_json())
        print(f"tile table: {len(table_rows)} entries -> {a.tiles_out}", flush=True)


if __name__ == "__main__":
    main()
