"""`loraserve bench ...`: generate workloads, replay them, simulate clusters."""

from __future__ import annotations

import argparse
import json
import os

from vllm_loraserve.adapters.record import write_catalog
from vllm_loraserve.workloads import generators
from vllm_loraserve.workloads.trace import write_trace


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


def _replay(a: argparse.Namespace) -> None:
    import asyncio

    from vllm_loraserve.bench import replay
    from vllm_loraserve.workloads.trace import read_trace

    trace = read_trace(a.trace)
    if a.limit:
        trace = trace[:a.limit]
    if a.map_by_rank:
        mapping = replay.map_by_rank(trace, replay.served_adapters(a.url))
    else:
        mapping = json.load(open(a.model_map)) if a.model_map else {}
    outcomes = asyncio.run(replay.replay(
        trace, a.url, model_for=lambda r: mapping.get(r.adapter, r.adapter),
        time_scale=a.time_scale, vocab=(a.token_id_min, a.token_id_max), seed=a.seed))
    summary = replay.summarize(outcomes, slo_ttft_s=a.slo_ttft, slo_tpot_s=a.slo_tpot)
    replay.save(a.out, outcomes, summary, {"trace": a.trace, "url": a.url,
                                           "time_scale": a.time_scale})
    t, p = summary["ttft_s"], summary["tpot_s"]
    print(f"{summary['requests']} requests, {summary['errors']} errors, "
          f"{summary['throughput_req_s']:.2f} req/s, "
          f"{summary['throughput_output_tok_s']:.1f} output tok/s; "
          f"TTFT mean {t.get('mean', float('nan')):.3f}s p95 {t.get('p95', float('nan')):.3f}s; "
          f"TPOT mean {p.get('mean', float('nan')):.4f}s"
          + (f"; SLO attainment {summary['slo_attainment']:.1%}"
             if "slo_attainment" in summary else "") + f" -> {a.out}")
    if summary["errors"]:
        first = next(o for o in outcomes if o.error)
        print(f"first error: request {first.request_id}: {first.error}")


def _simulate(a: argparse.Namespace) -> None:
    import shlex
    import sys

    from vllm_loraserve.adapters.record import read_catalog
    from vllm_loraserve.perf.operating import load_profile
    from vllm_loraserve.workloads.generators import LORASERVE_RANKS
    from vllm_loraserve.workloads.trace import read_trace

    if a.report:
        from vllm_loraserve.bench.sim_report import run_report

        profile = load_profile(a.profile, LORASERVE_RANKS)
        command = "loraserve " + " ".join(shlex.quote(x) for x in sys.argv[1:])
        run_report(profile, a.report, command, workers=a.workers, quick=a.quick)
        print(f"wrote {a.report}")
        return
    if not (a.trace and a.catalog):
        raise SystemExit("give --trace and --catalog (one run) or --report PATH (the study)")
    from vllm_loraserve.sim.cluster import ClusterConfig, simulate

    catalog = read_catalog(a.catalog)
    profile = load_profile(a.profile, {x.rank for x in catalog})
    result = simulate(read_trace(a.trace), catalog, profile,
                      ClusterConfig(num_engines=a.engines, policy=a.policy,
                                    rebalance_s=a.rebalance or None, seed=a.seed,
                                    warm_start_s=a.warm_start))
    summary = result.summary(a.slo_ttft)
    text = json.dumps(summary, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


def _plot(a: argparse.Namespace) -> None:
    from vllm_loraserve.bench import plots

    (plots.latency_vs_rate if a.kind == "rate" else plots.latency_cdfs)(a.results, a.out)
    print(f"wrote {a.out}")


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

    r = bsub.add_parser("replay", help="replay a trace against an OpenAI-compatible server")
    r.add_argument("--trace", required=True)
    r.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--out", required=True, help="results JSON")
    r.add_argument("--time-scale", type=float, default=1.0,
                   help="speed-up of the trace's clock (2: twice as fast)")
    r.add_argument("--map-by-rank", action="store_true",
                   help="send each trace adapter as a served adapter of the same rank")
    r.add_argument("--model-map", help="JSON file: trace adapter -> served model name")
    r.add_argument("--limit", type=int, help="replay only the first N requests")
    r.add_argument("--slo-ttft", type=float, help="SLO: TTFT at most this (s)")
    r.add_argument("--slo-tpot", type=float, help="SLO: TPOT at most this (s)")
    r.add_argument("--token-id-min", type=int, default=10)
    r.add_argument("--token-id-max", type=int, default=200,
                   help="prompts are random token ids in [min, max): keep max <= the vocab")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_replay)

    sm = bsub.add_parser("simulate", help="simulate a cluster (one run, or the whole study)")
    sm.add_argument("--report", help="run the study of docs/benchmarks/simulation.md and "
                                     "write the report here (plus .json and .png beside it)")
    sm.add_argument("--quick", action="store_true", help="report: fewer, shorter runs")
    sm.add_argument("--workers", type=int, help="report: parallel processes (default: cores)")
    sm.add_argument("--trace", help="one run: trace JSONL")
    sm.add_argument("--catalog", help="one run: adapter catalogue JSON")
    sm.add_argument("--engines", type=int, default=4)
    sm.add_argument("--policy", choices=("random", "contiguous", "toppings", "loraserve"),
                    default="loraserve")
    sm.add_argument("--rebalance", type=float, default=30.0, help="seconds (0: never)")
    sm.add_argument("--warm-start", type=float, default=0.0,
                    help="one run: place first from the demand of the trace's first seconds "
                         "(0: from no demand, as a router that just started)")
    sm.add_argument("--profile", help="profile JSON (default: the documented default model)")
    sm.add_argument("--slo-ttft", type=float, default=10.0)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--out", help="one run: write the summary JSON here too")
    sm.set_defaults(func=_simulate)

    pl = bsub.add_parser("plot", help="plot replay results")
    pl.add_argument("--kind", choices=("cdf", "rate"), default="cdf",
                    help="cdf: TTFT/TPOT CDFs; rate: latency vs request rate over runs")
    pl.add_argument("--out", required=True, help="PNG to write")
    pl.add_argument("results", nargs="+", help="results JSON files of bench replay")
    pl.set_defaults(func=_plot)


def _gen_with_defaults(a: argparse.Namespace) -> None:
    if a.seed is None:
        a.seed = 42 if a.kind == "slora" else 0
    if a.duration is None and a.kind != "azure":
        a.duration = 60.0
    _gen(a)
