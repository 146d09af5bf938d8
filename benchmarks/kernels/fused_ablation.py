"""A module's LoRA in one launch (a prototype for issue 23 item 2, "shrink and
expand fused where that pays"), against the pool's two launches, on the
engine's path (`DevicePool.add_lora`, CUDA graphs over `LAYERS` layers).

At small steps a module's LoRA time is a fixed cost: two launches, each a
chain of dependent reads before its weights (docs/benchmarks/kernels.md,
session 25: ~27 us a Llama-2 layer for one rank-8 adapter at 64 tokens,
where the bytes need ~2 us). Here one launch holds S programs of the
stream-K shrink (triton_mbgmm's `_shrink_stream_kernel`, unchanged) and E
programs of the expand (`_expand_kernel`'s loop). An expand program reads its
block's metadata, its rows of y and its first tile of B while the shrink
runs, and waits on the device only before its first read of h.

Deadlock freedom: each program takes a ticket from a counter (an atomic add)
when it starts, and its role from the ticket, not from its program id:
tickets below S shrink. An expand program that waits thus holds a ticket past
every shrink program's, so every shrink program has started, and none of
them waits for anything. Counters are never reset: launch L of a plan holds
tickets [L N, (L + 1) N), N = S + E, and waits for arrivals (L + 1) S. The
launches of one plan run one after another on one stream, never two at once.
Under Triton's interpreter (the CPU test, tests/bench/test_fused_ablation.py)
programs run one after another in ticket order, so no expand program waits.

Memory order (as compiled for sm_90, read in its PTX): Triton performs a
scalar atomic in one thread of the program and broadcasts its result. A
shrink program's threads meet at a barrier after their adds into h, then
one thread adds its arrival with release semantics. An expand program's
threads spin on a volatile load of the arrivals; then one thread
loads them with acquire semantics, a barrier follows, and h is read from L2
(`.cg`).

Not on the engine's path. A variant is `fused-K`: S = E = K programs per SM
(E rounded up to whole (column tile, slice) sets).

    PYTHONPATH=src python benchmarks/kernels/fused_ablation.py --shape llama2-7b \\
        --targets qkvo --mixes single-r8,pow-100 --tokens 16,64,256 --per-sm 1,2,4 \\
        --out fused.json

Needs torch and triton on a CUDA device (the CPU test runs `fused_module`
under the interpreter); vLLM is not used.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from vllm_loraserve.kernels.batch import JOB_COLS, ModuleSlices, SlotTable, TokenBatch
from vllm_loraserve.kernels.triton_mbgmm import (
    ZERO_BLOCK,
    _desc,
    _num_sms,
    _panel_runs,
    _shrink_columns,
    expand_tiles,
    stream_tiles,
)
from vllm_loraserve.paging.layout import LayerLayout


@triton.jit(do_not_specialize=["next_numel"])
def _fused_kernel(
    x_ptr, pool_ptr, h_ptr, y_ptr, tok_ptr, rank_ptr, seg_ptr, pages_ptr, jobs_ptr, njobs_ptr,
    blocks_ptr, nblocks_ptr, desc_ptr, next_ptr, next_numel, sync_ptr, S, E, P0,
    K, page_size, num_segs, max_pages, seg0,
    stride_xt, stride_hs, stride_ht, stride_yt,
    BM: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, COUNT: tl.constexpr,
    EVEN_K: tl.constexpr, PANEL: tl.constexpr, ZB: tl.constexpr, JC: tl.constexpr,
    EBN: tl.constexpr, EBK: tl.constexpr, COLB: tl.constexpr, ALIGNED: tl.constexpr,
):
    ticket = tl.atomic_add(sync_ptr, 1)
    n = S + E
    role = (ticket % n).to(tl.int32)
    if role < S:
        # -- the stream-K shrink, program `role` of S (_shrink_stream_kernel) --
        zper = tl.cdiv(tl.cdiv(next_numel, S), ZB) * ZB
        z0 = role * zper
        for z in range(z0, tl.minimum(z0 + zper, next_numel), ZB):
            offs_z = z + tl.arange(0, ZB)
            tl.store(next_ptr + offs_z, tl.zeros((ZB,), tl.float32), mask=offs_z < next_numel)
        chunks = tl.cdiv(K, SBK)
        units = tl.load(njobs_ptr) * COUNT * chunks
        per = tl.cdiv(units, S)
        u = role * per
        u_end = tl.minimum(u + per, units)
        offs_m = tl.arange(0, BM)
        while u < u_end:
            piece = u // chunks
            c0 = u % chunks
            c1 = tl.minimum(chunks, c0 + (u_end - u))
            job = piece // COUNT
            s = piece % COUNT
            slot = tl.load(jobs_ptr + job * JC)
            start = tl.load(jobs_ptr + job * JC + 1)
            length = tl.load(jobs_ptr + job * JC + 2)
            n0 = tl.load(jobs_ptr + job * JC + 3)
            rank = tl.load(rank_ptr + slot)
            seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
            m_mask = offs_m < length
            toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
            if (seg_off >= 0) & (n0 < rank):
                offs_n = n0 + tl.arange(0, SBN)
                n_mask = offs_n < rank
                page_row = pages_ptr + slot * max_pages
                acc = _shrink_columns(x_ptr, pool_ptr, page_row, toks, m_mask, offs_n, n_mask,
                                      seg_off, rank, c0 * SBK, tl.minimum(c1 * SBK, K), K,
                                      page_size, stride_xt, BM, SBN, SBK, EVEN_K, PANEL)
                out = h_ptr + s * stride_hs + toks[:, None] * stride_ht + offs_n[None, :]
                tl.atomic_add(out, acc, mask=m_mask[:, None] & n_mask[None, :])
            u += c1 - c0
        # One thread adds a scalar atomic: the barrier first puts every
        # thread's adds into h before its release (the classic
        # syncthreads-then-fence of a last-block reduction).
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")  # this program's h is in
    else:
        # -- the expand (_expand_kernel): program (pid0, pid1, s) of (P0, COLB, COUNT) --
        e = role - S
        s = e % COUNT
        pid1 = (e // COUNT) % COLB
        pid0 = e // (COUNT * COLB)
        target = (ticket // n + 1) * S  # this launch's shrink programs all arrived
        n_out = tl.load(desc_ptr + s * 2)
        col0 = tl.load(desc_ptr + s * 2 + 1)
        if ALIGNED:
            col0 = tl.multiple_of(col0, 16)
            n_out = tl.multiple_of(n_out, 16)
        offs_m = tl.arange(0, BM)
        offs_j = tl.arange(0, EBK)
        n0 = pid1 * EBN
        offs_n = n0 + tl.arange(0, EBN)
        n_mask = offs_n < n_out
        waited = tl.zeros((), tl.int32)
        nblocks = tl.where(n0 < n_out, tl.load(nblocks_ptr), 0)
        for blk in range(pid0, nblocks, P0):
            slot = tl.load(blocks_ptr + blk * 3)
            start = tl.load(blocks_ptr + blk * 3 + 1)
            length = tl.load(blocks_ptr + blk * 3 + 2)
            seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 1 + 2 * s)
            rank = tl.load(rank_ptr + slot)
            m_mask = offs_m < length
            toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
            if seg_off >= 0:
                h_rows = h_ptr + s * stride_hs + toks[:, None] * stride_ht
                out = y_ptr + toks[:, None] * stride_yt + col0 + offs_n[None, :]
                page_row = pages_ptr + slot * max_pages
                mask = m_mask[:, None] & n_mask[None, :]
                acc = tl.load(out, mask=mask, other=0.0).to(tl.float32)
                for j0 in range(0, rank, EBK):
                    j_mask = (j0 + offs_j) < rank
                    base = _panel_runs(page_row, seg_off, rank, n0, j0 + offs_j, j_mask,
                                       page_size, PANEL)
                    w = tl.load(pool_ptr + base[:, None] + tl.arange(0, EBN)[None, :],
                                mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                    # y and this tile of B are on their way: only h waits for the shrink.
                    if waited == 0:
                        while tl.load(sync_ptr + 1, volatile=True) < target:
                            pass
                        tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
                        tl.debug_barrier()  # every thread reads h after the acquire
                        waited += 1
                    # h is zero past each rank up to EBK (the stream-K shrink zeroed it).
                    hj = tl.load(h_rows + (j0 + offs_j)[None, :], mask=m_mask[:, None],
                                 other=0.0, cache_modifier=".cg")
                    acc += tl.dot(hj.to(w.dtype), w)
                tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


class FusedLauncher:
    """`fused_module` with a ticket counter per plan (grid)."""

    def __init__(self, per_sm: int) -> None:
        self.per_sm = per_sm
        self._sync: dict[tuple, torch.Tensor] = {}  # (S, E, device) -> [tickets, arrivals]
        self.launches: dict[tuple, int] = {}  # the same keys: launches so far

    def __call__(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
                 batch: TokenBatch, slots: SlotTable, module: ModuleSlices,
                 layout: LayerLayout, h_zeroed: bool, zero_next: torch.Tensor) -> None:
        """As `backend.shrink` then `backend.expand` (stream-K path: the batch
        has jobs), in one launch."""
        if batch.jobs is None:
            raise ValueError("the fused module runs on a batch's jobs (stream-K)")
        k, rows = module.in_features, module.out_rows
        st = stream_tiles(batch, k)
        et = expand_tiles(batch, max(n for n, _ in rows))
        if h.shape[-1] % et.block_k:
            raise ValueError(f"h's {h.shape[-1]} rank columns are not a multiple of {et.block_k}")
        sms = _num_sms(x.device) if x.device.type == "cuda" else 4
        colb = triton.cdiv(max(n for n, _ in rows), et.block_n)
        shrink_programs = self.per_sm * sms
        p0 = triton.cdiv(self.per_sm * sms, colb * module.count)
        expand_programs = p0 * colb * module.count
        key = (shrink_programs, expand_programs, x.device)
        sync = self._sync.get(key)
        if sync is None:
            sync = self._sync[key] = torch.zeros(2, dtype=torch.int64, device=x.device)
        self.launches[key] = self.launches.get(key, 0) + 1
        if not h_zeroed:
            h.zero_()
        _fused_kernel[(shrink_programs + expand_programs,)](
            x, pool, h, y, batch.sorted_tokens, slots.rank, slots.seg_offsets, slots.pages,
            batch.jobs, batch.num_jobs_dev, batch.blocks, batch.num_blocks_dev,
            _desc(tuple(rows), y.device), zero_next, zero_next.numel(), sync,
            shrink_programs, expand_programs, p0,
            k, layout.page_size, layout.num_segments, slots.pages.shape[1], 2 * module.first,
            x.stride(0), h.stride(0), h.stride(1), y.stride(0),
            BM=batch.block_m, SBN=st.block_n, SBK=st.block_k, COUNT=module.count,
            EVEN_K=k % st.block_k == 0, PANEL=layout.panel, ZB=ZERO_BLOCK, JC=JOB_COLS,
            EBN=et.block_n, EBK=et.block_k, COLB=colb,
            ALIGNED=all(n % 16 == 0 and col % 16 == 0 for n, col in rows),
            num_warps=4, num_stages=2)


def fused_add_lora(pool, launcher: FusedLauncher, layer: int, module: ModuleSlices,
                   x: torch.Tensor, y: torch.Tensor) -> None:
    """`DevicePool.add_lora`'s loop over the step's batchings with the fused
    launch (h turns and zeroing as the pool keeps them)."""
    call = (layer, module.first)
    if call <= pool._last_call:
        pool._h_turn, pool._h_zeroed = 0, None
    pool._last_call = call
    tokens = x.shape[0]
    for batch in pool._batches_for(tokens, False):
        turn = pool._h_turn
        h = pool.h_view(turn, module.count, tokens)
        launcher(x, pool.pages[layer], h, y, batch, pool.table, module, pool.layout,
                 h_zeroed=pool._h_zeroed == tokens, zero_next=pool._h_rows(1 - turn, tokens))
        pool._h_turn, pool._h_zeroed = 1 - turn, tokens


def forward(pool, launcher: FusedLauncher | None, layers: int, module: ModuleSlices,
            x: torch.Tensor, y: torch.Tensor) -> None:
    """`module`'s LoRA in `layers` layers: the pool's launches (launcher
    None) or the fused one."""
    for layer in range(layers):
        if launcher is None:
            pool.add_lora(layer, module, x, y)
        else:
            fused_add_lora(pool, launcher, layer, module, x, y)


def replay_errors(run, y: torch.Tensor, y0: torch.Tensor, want: torch.Tensor,
                  replays: int = 20) -> float:
    """The largest error of y - y0 against `want` over `replays` replays of a
    CUDA graph that restores y0 and runs `run` (captured as engine_grid's
    graph_us captures): what the timed replays compute, checked."""
    def body() -> None:
        y.copy_(y0)
        run()

    body()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    worst = 0.0
    for _ in range(replays):
        graph.replay()
        worst = max(worst, ((y - y0).float() - want).abs().max().item())
    del graph
    return worst


def case(shape: dict, kinds: tuple[str, ...], mix: str, tokens: int, dev: torch.device,
         launchers: dict[str, FusedLauncher]) -> dict:
    """µs a layer of each module kind, the pool's launches against each fused
    variant, after checking that each variant's y equals the pool's, eagerly
    and in graph replays."""
    from engine_grid import LAYERS, MODULES, build, graph_us

    pool, step_bytes, distinct = build(shape, kinds, mix, tokens, dev)
    row = dict(mix=mix, tokens=tokens, distinct=distinct,
               mb_per_layer=round(step_bytes / LAYERS / 1e6, 2))
    for kind in kinds:
        m = ModuleSlices.of(pool.layout, MODULES[kind])
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(tokens, m.in_features, device=dev, dtype=torch.bfloat16, generator=g)
        y0 = torch.randn(tokens, sum(m.out_features), device=dev, dtype=torch.bfloat16,
                         generator=g)
        want = None
        cell = {}
        for name, launcher in [("separate", None), *launchers.items()]:
            y = y0.clone()
            forward(pool, launcher, LAYERS, m, x, y)
            got = (y - y0).float()
            if want is None:
                want = got
            run = functools.partial(forward, pool, launcher, LAYERS, m, x, y)
            err = max((got - want).abs().max().item(), replay_errors(run, y, y0, want))
            if err > 0.02 * want.abs().max().item() + 1e-3:
                raise SystemExit(f"{name} {mix} {tokens} {kind}: off by {err}")
            cell[f"{name}_us"] = round(graph_us(run) / LAYERS, 2)
        row[kind] = cell
    for name in ["separate", *launchers]:
        row[f"{name}_layer_us"] = round(sum(row[k][f"{name}_us"] for k in kinds), 2)
    return row


def main() -> None:
    from engine_grid import LAYERS, SHAPES, TARGETS, copy_tb_s

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="qkvo")
    ap.add_argument("--mixes", default="single-r8,pow-100")
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--per-sm", default="1,2,4")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    peak = copy_tb_s(dev)
    print(f"copy: {peak:.2f} TB/s", flush=True)
    launchers = {f"fused-{k}": FusedLauncher(int(k)) for k in a.per_sm.split(",")}
    rows = []
    for mix in a.mixes.split(","):
        for t in (int(v) for v in a.tokens.split(",")):
            row = case(SHAPES[a.shape], TARGETS[a.targets], mix, t, dev, launchers)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "shape": a.shape, "targets": a.targets,
               "layers": LAYERS, "copy_tb_s": round(peak, 3), "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
