"""How fast the NaN/Inf/overflow check runs, beside the read it now rides on.

The paged pool's reader reads an adapter's weights file into the host tier
with one `readinto` and checks the values in that buffer
(adapters/peft.py `read_weights(path, alloc, max_value)`); the API server no
longer reads the tensors. For PEFT adapters of the Llama-2-7B shape (hidden
4096, 32 layers, q/k/v/o, bf16) at ranks 16, 32 and 64, this times, one
thread with one intra-op thread as on a reader (host_tier.py):

- `read_cold`: the read alone (no check) after the file's pages were dropped
  from the page cache (posix_fadvise DONTNEED), i.e. from the disk;
- `read_warm`: the read alone, the file in the page cache;
- `check`: `check_weight_values` over the bytes already read (what the check
  adds to a read);
- `read_check_cold` / `read_check_warm`: the reader's whole call;
- `previous`: what the API server did before, a second read of the file
  (safetensors `load_file`) with `isfinite(t).all()` and `t.abs().max()`
  per tensor;
- `read_check_parts_cold` / `read_check_parts_warm`: the reader's whole call
  split into pieces of `PART_BYTES` over `--parts` threads, as
  worker/paged_manager.py reads (its `read_threads`, 4 by default).

Rates are the file data's bytes over the median time of `--reps` runs;
adapters/s is files over the summed medians.

    python benchmarks/cold_start/check_rate.py --out check_rate.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_loraserve.adapters.peft import (
    PART_BYTES,
    SAFETENSORS_FILE,
    _read_tensors,
    check_weight_values,
    inspect_adapter,
    read_weights,
    write_adapter,
)

H, LAYERS, MODULES = 4096, 32, ("q_proj", "k_proj", "v_proj", "o_proj")
BF16_MAX = torch.finfo(torch.bfloat16).max


def make(root: str, ranks: list[int]) -> list[str]:
    paths = []
    for i, r in enumerate(ranks):
        d = os.path.join(root, f"r{r}-{i}")
        if not os.path.exists(os.path.join(d, "adapter_config.json")):
            g = torch.Generator().manual_seed(i)
            weights = {f"model.layers.{la}.self_attn.{m}": (
                torch.randn(r, H, generator=g).bfloat16(),
                (0.01 * torch.randn(H, r, generator=g)).bfloat16())
                for la in range(LAYERS) for m in MODULES}
            write_adapter(d, weights, rank=r, alpha=2 * r, base_model="llama-2-7b-shape")
        paths.append(d)
    return paths


def drop_cache(path: str) -> None:
    """Evict the weights file's pages from the page cache (clean pages: no
    privilege needed), so the next read comes from the disk."""
    st = os.path.join(path, SAFETENSORS_FILE)
    fd = os.open(st, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def previous_check(path: str) -> None:
    """The API server's check before this change: its own read, then two
    passes and two temporaries per tensor."""
    for t in _read_tensors(path).values():
        assert bool(torch.isfinite(t).all())
        float(t.abs().max())


def timed(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(path: str, reps: int, parts: ThreadPoolExecutor) -> dict:
    spec, raw = read_weights(path, alloc)
    nbytes = raw.data.numel()

    def check() -> None:
        check_weight_values(spec, ((f"lora_{k} of {m}", t, k == "B")
                                   for m, ab in raw.tensors().items()
                                   for k, t in zip("AB", ab, strict=True)), BF16_MAX)

    cold = lambda: drop_cache(path)  # noqa: E731
    seconds = {
        "read_cold": timed(lambda: read_weights(path, alloc), reps, cold),
        "read_warm": timed(lambda: read_weights(path, alloc), reps),
        "check": timed(check, reps),
        "read_check_cold": timed(lambda: read_weights(path, alloc, BF16_MAX), reps, cold),
        "read_check_warm": timed(lambda: read_weights(path, alloc, BF16_MAX), reps),
        "previous": timed(lambda: previous_check(path), reps),
        "read_check_parts_cold": timed(lambda: read_weights(path, alloc, BF16_MAX, parts),
                                       reps, cold),
        "read_check_parts_warm": timed(lambda: read_weights(path, alloc, BF16_MAX, parts),
                                       reps),
    }
    return {"adapter": os.path.basename(path), "rank": spec.rank, "bytes": nbytes,
            "seconds": seconds,
            "gb_per_s": {k: nbytes / s / 1e9 for k, s in seconds.items()}}


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/loraserve-check-rate",
                    help="where the adapters are written (kept for later runs)")
    ap.add_argument("--ranks", default="16,32,64,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="check_rate.json")
    ap.add_argument("--parts", type=int, default=4,
                    help="threads of the split read (the plugin: --loraserve-read-threads)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as on the host tier's readers
    paths = make(args.root, [int(r) for r in args.ranks.split(",")])
    for p in paths:
        inspect_adapter(p)
    with ThreadPoolExecutor(args.parts, initializer=torch.set_num_threads,
                            initargs=(1,)) as parts:
        rows = [measure(p, args.reps, parts) for p in paths]
    total = sum(r["bytes"] for r in rows)
    summary = {k: {"gb_per_s": total / sum(r["seconds"][k] for r in rows) / 1e9,
                   "adapters_per_s": len(rows) / sum(r["seconds"][k] for r in rows)}
               for k in rows[0]["seconds"]}
    out = {"date": datetime.date.today().isoformat(), "machine": cpu_name(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "shape": {
               "hidden": H, "layers": LAYERS, "modules": MODULES, "dtype": "bf16"},
           "reps": args.reps, "parts_threads": args.parts, "part_bytes": PART_BYTES,
           "adapters": rows, "summary": summary}
    print(f"{len(rows)} adapters, {total / 1e6:.0f} MB of tensor data, 1 thread "
          f"(parts: {args.parts} more), median of {args.reps}")
    print(f"{'':18} {'GB/s':>8} {'adapters/s':>11}")
    for k, v in summary.items():
        print(f"{k:18} {v['gb_per_s']:8.2f} {v['adapters_per_s']:11.1f}")
    for r in rows:
        print(f"  {r['adapter']:8} {r['bytes'] / 1e6:6.1f} MB  " + "  ".join(
            f"{k} {v:.2f}" for k, v in r["gb_per_s"].items()))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
