"""`loraserve bench ...`: generate workloads, replay them, simulate clusters."""

from __future__ import annotations

import argparse
import os

from vllm_loraserve.workloads import generators
from vllm_loraserve.workloads.trace import write_catalog, write_trace


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi)


def _gen(a: argparse.Namespace) -> None:
    if a.kind == "slora":
        catalog, requests = generators.slora(
            a.num_adapters, ranks=a.ranks, alpha=a.alpha, rate=a.rate, cv=a.cv,
            duration=a.duration, input_range=a.input_range, output_range=a.output_range,
            seed=a.seed)
    elif a.kind == "loraserve":
        catalog, requests = generators.loraserve(
            a.num_adapters, popularity=a.popularity, arrival=a.arrival, rate=a.rate,
            duration=a.duration, alpha=a.alpha, rank_alpha=a.rank_alpha,
            input_range=a.input_range, output_range=a.output_range,
            lengths_from=a.lengths_from, seed=a.seed)
    else:
        catalog, requests = generators.azure(
            a.num_adapters, rate=a.rate, path=a.csv, duration=a.duration,
            popularity=a.popularity, alpha=a.alpha, rank_alpha=a.rank_alpha,
            max_prompt_len=a.max_prompt_len, max_output_len=a.max_output_len, seed=a.seed)
    write_trace(a.out, requests)
    catalog_path = a.catalog or os.path.splitext(a.out)[0] + ".adapters.json"
    write_catalog(catalog_path, catalog)
    span = requests[-1].arrival_s if requests else 0.0
    print(f"wrote {len(requests)} requests over {span:.1f}s to {a.out} and "
          f"{len(catalog)} adapters to {catalog_path}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="workloads, replay and simulation")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    g = bsub.add_parser("gen", help="write a JSONL trace and its adapter catalogue",
                        description=generators.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--kind", choices=("slora", "loraserve", "azure"), required=True)
    g.add_argument("--out", required=True, help="trace file (JSONL)")
    g.add_argument("--catalog", help="adapter catalogue (default: OUT with .adapters.json)")
    g.add_argument("--num-adapters", type=int, default=100)
    g.add_argument("--rate", type=float, default=1.0, help="requests per second")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds (default: 60; azure: the whole trace)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed (default: 42 for slora, as S-LoRA; 0 otherwise)")
    g.add_argument("--alpha", type=float, default=1.0,
                   help="slora: power-distribution exponent of adapter choice; "
                        "loraserve/azure: power-law exponent of adapters within a rank")
    g.add_argument("--ranks", type=int, nargs="+", default=list(generators.LORASERVE_RANKS),
                   help="slora: ranks, assigned round-robin")
    g.add_argument("--cv", type=float, default=1.0, help="slora: inter-arrival CV")
    g.add_argument("--input-range", type=_range, default=(8, 512), help="LO,HI (HI excluded)")
    g.add_argument("--output-range", type=_range, default=(8, 512), help="LO,HI (HI excluded)")
    g.add_argument("--popularity", choices=generators.RANK_POPULARITIES, default="uniform",
                   help="loraserve/azure: rank popularity")
    g.add_argument("--rank-alpha", type=float, default=1.0,
                   help="loraserve/azure with --popularity powerlaw: exponent over ranks")
    g.add_argument("--arrival", choices=("poisson", "uniform"), default="poisson",
                   help="loraserve: arrival process")
    g.add_argument("--lengths-from", help="loraserve: draw lengths from this Azure CSV")
    g.add_argument("--csv", default=generators.AZURE_CONV, help="azure: trace CSV")
    g.add_argument("--max-prompt-len", type=int, help="azure: clip prompt lengths")
    g.add_argument("--max-output-len", type=int, help="azure: clip output lengths")
    g.set_defaults(func=_gen_with_defaults)


def _gen_with_defaults(a: argparse.Namespace) -> None:
    if a.seed is None:
        a.seed = 42 if a.kind == "slora" else 0
    if a.duration is None and a.kind != "azure":
        a.duration = 60.0
    _gen(a)
