"""The cluster simulation study behind docs/benchmarks/simulation.md.

One command runs it all (`loraserve bench simulate --report PATH`):

1. P95 TTFT against request rate for the placement policies (random,
   contiguous, toppings, loraserve) on the six LoRAServe traces (rank
   popularity uniform / shifting / exponential x Poisson / uniform arrivals),
   4 engines, 100 adapters (20 per rank), Azure conversation-trace lengths;
2. throughput under the P95 TTFT SLO, read off those sweeps;
3. weak scaling: 4 / 8 / 12 engines with 100 / 200 / 300 adapters and
   proportional load;
4. sensitivity to the skew of rank popularity (power law over ranks,
   alpha 1/3, 1, 3; LoRAServe §V-H);
5. the number of engines each policy needs to serve a given load in SLO.

Each study runs twice: with the profile's step model costed as MBGMV (LoRA
work follows the sum of ranks: our kernels) and as BGMV (padded to the
largest rank in the step: Punica, and Toppings' model), because whether rank
heterogeneity costs anything decides which placement wins.

Rates are fractions of an estimated cluster capacity: engines x the mean
per-rank operating point / mean tokens per request. Every simulation is
deterministic (seeded); they run in parallel worker processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from vllm_loraserve.perf.model import Profile, StepModel
from vllm_loraserve.sim.cluster import ClusterConfig, simulate
from vllm_loraserve.workloads import generators

POLICIES = ("random", "contiguous", "toppings", "loraserve")
POPULARITIES = ("uniform", "shifting", "exponential")
ARRIVALS = ("poisson", "uniform")
LOADS = (0.3, 0.5, 0.7, 0.85, 1.0, 1.15)
RANKS = generators.LORASERVE_RANKS


KINDS = ("mbgmv", "bgmv")


@dataclass(frozen=True)
class Job:
    kind: str  # how the step model costs LoRA work
    study: str
    policy: str
    engines: int
    adapters: int
    popularity: str
    arrival: str
    rate: float
    load: float  # rate as a fraction of the capacity estimate
    rank_alpha: float = 1.0


@dataclass(frozen=True)
class Settings:
    duration_s: float = 240.0
    rebalance_s: float = 30.0
    slo_ttft_p95_s: float = 10.0
    seed: int = 0


def _mean_tokens() -> float:
    _, p, o = generators.read_azure(generators.AZURE_CONV)
    return float(np.mean(p + np.maximum(o, 1)))


def capacity_rps(profile: Profile, engines: int) -> float:
    """Requests/s a cluster sustains at the mean operating point."""
    mean_op = float(np.mean([profile.operating_points[r] for r in RANKS]))
    return engines * mean_op / _mean_tokens()


def run_job(args: tuple[Job, dict, Settings]) -> dict:
    job, profile_json, st = args
    profile = Profile.from_json(profile_json)
    profile = dataclasses.replace(profile, step=StepModel(job.kind, profile.step.coef))
    catalog, trace = generators.loraserve(
        job.adapters, popularity=job.popularity, arrival=job.arrival, rate=job.rate,
        duration=st.duration_s, rank_alpha=job.rank_alpha,
        lengths_from=generators.AZURE_CONV, seed=st.seed)
    config = ClusterConfig(num_engines=job.engines, policy=job.policy,
                           rebalance_s=st.rebalance_s, warm_start_s=st.rebalance_s,
                           seed=st.seed, max_time_s=3 * st.duration_s)
    t0 = time.perf_counter()
    summary = simulate(trace, catalog, profile, config).summary(st.slo_ttft_p95_s)
    return {"job": asdict(job), "wall_s": time.perf_counter() - t0, **summary}


def jobs(profile: Profile, quick: bool = False) -> list[Job]:
    out = []
    cap4 = capacity_rps(profile, 4)
    loads = LOADS[1::2] if quick else LOADS
    for kind in KINDS:
        for pop in POPULARITIES:
            for arr in ARRIVALS:
                for load in loads:
                    for pol in POLICIES:
                        out.append(Job(kind, "sweep", pol, 4, 100, pop, arr, load * cap4, load))
        for k, n in ((4, 100), (8, 200), (12, 300)):
            for load in (0.5, 0.85):
                for pol in POLICIES:
                    out.append(Job(kind, "scaling", pol, k, n, "uniform", "poisson",
                                   load * capacity_rps(profile, k), load))
        for alpha in (1 / 3, 1.0, 3.0):
            for pol in POLICIES:
                out.append(Job(kind, "alpha", pol, 4, 100, "powerlaw", "poisson", 0.85 * cap4,
                               0.85, rank_alpha=alpha))
        target = 2 * cap4  # a load for which about 8 engines are needed
        for k in (6, 7, 8, 9, 10, 12, 14, 16):
            for pol in POLICIES:
                out.append(Job(kind, "engines", pol, k, 100, "shifting", "poisson", target,
                               target / capacity_rps(profile, k)))
    return out


def _fmt(x: float) -> str:
    return "timeout" if not math.isfinite(x) else f"{x:.2f}"


def _max_rate_in_slo(rows: list[dict], slo: float) -> str:
    """The highest swept rate meeting the SLO, linearly interpolated in
    log(P95) to the first rate that breaks it."""
    rows = sorted(rows, key=lambda r: r["job"]["rate"])
    ok = [r for r in rows if r["ttft_p95_s"] <= slo]
    if not ok:
        return f"< {rows[0]['job']['rate']:.1f}"
    best = ok[-1]
    later = [r for r in rows if r["job"]["rate"] > best["job"]["rate"]]
    if not later:
        return f">= {best['job']['rate']:.1f}"
    bad = later[0]
    if not math.isfinite(bad["ttft_p95_s"]):
        return f"{best['job']['rate']:.1f}"
    a, b = math.log(max(best["ttft_p95_s"], 1e-6)), math.log(bad["ttft_p95_s"])
    f = (math.log(slo) - a) / (b - a) if b > a else 0.0
    return f"{best['job']['rate'] + f * (bad['job']['rate'] - best['job']['rate']):.1f}"


def _plot_sweeps(results: list[dict], path: str, slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharey=True)
    cap = 3 * max(r["job"]["rate"] for r in results)  # timeouts drawn at the top
    for ax, (arr, pop) in zip(axes.flat, [(a, p) for a in ARRIVALS for p in POPULARITIES],
                              strict=True):
        for pol in POLICIES:
            rows = sorted((r for r in results if r["job"]["policy"] == pol
                           and r["job"]["popularity"] == pop and r["job"]["arrival"] == arr),
                          key=lambda r: r["job"]["rate"])
            y = [r["ttft_p95_s"] if math.isfinite(r["ttft_p95_s"]) else cap for r in rows]
            ax.plot([r["job"]["rate"] for r in rows], y, "o-", label=pol)
        ax.axhline(slo, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"{pop} popularity, {arr} arrivals")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3, which="both")
    for ax in axes[:, 0]:
        ax.set_ylabel("P95 TTFT (s)")
    axes.flat[0].legend()
    fig.suptitle("Simulated P95 TTFT, 4 engines, 100 adapters (dotted: SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


KIND_TITLES = {
    "mbgmv": "MBGMV kernels: LoRA work follows the sum of ranks (our kernels)",
    "bgmv": "Padded BGMV kernels: LoRA work follows tokens x the step's largest rank",
}


def _kind_section(results: list[dict], kind: str, st: Settings, base: str) -> list[str]:
    plot_path = f"{base}-{kind}-ttft-vs-rps.png"
    sweep = [r for r in results if r["job"]["study"] == "sweep"]
    _plot_sweeps(sweep, plot_path, st.slo_ttft_p95_s)
    by = lambda study: [r for r in results if r["job"]["study"] == study]  # noqa: E731
    head = "| trace | " + " | ".join(POLICIES) + " |"
    rule = "|---|" + "---|" * len(POLICIES)
    lines = [f"## {KIND_TITLES[kind]}", "",
             "### P95 TTFT against request rate (4 engines, 100 adapters)", "",
             f"![P95 TTFT vs rate, {kind}]({os.path.basename(plot_path)})", "",
             "### Throughput within the SLO (req/s)", "", head, rule]
    for arr in ARRIVALS:
        for pop in POPULARITIES:
            cells = [_max_rate_in_slo([r for r in sweep if r["job"]["policy"] == pol
                                       and r["job"]["popularity"] == pop
                                       and r["job"]["arrival"] == arr], st.slo_ttft_p95_s)
                     for pol in POLICIES]
            lines.append(f"| {pop}, {arr} | " + " | ".join(cells) + " |")
    load = max(r["job"]["load"] for r in sweep if r["job"]["load"] <= 0.85)
    lines += ["", f"### Largest number of adapters any engine held, at {load:.0%} load", "",
              head, rule]
    for arr in ARRIVALS:
        for pop in POPULARITIES:
            cells = []
            for pol in POLICIES:
                row = [r for r in sweep if r["job"]["policy"] == pol and r["job"]["load"] == load
                       and r["job"]["popularity"] == pop and r["job"]["arrival"] == arr]
                cells.append(str(max(row[0]["engine_adapters_seen"])) if row else "-")
            lines.append(f"| {pop}, {arr} | " + " | ".join(cells) + " |")
    lines += ["", "### Weak scaling (uniform popularity, Poisson): P95 TTFT (s)", "",
              "| engines / adapters | load | " + " | ".join(POLICIES) + " |",
              "|---|---|" + "---|" * len(POLICIES)]
    for k in (4, 8, 12):
        for ld in (0.5, 0.85):
            rows = {r["job"]["policy"]: r for r in by("scaling")
                    if r["job"]["engines"] == k and r["job"]["load"] == ld}
            any_row = next(iter(rows.values()))["job"]
            lines.append(f"| {k} / {any_row['adapters']} | {ld:.0%} ({any_row['rate']:.0f} "
                         "req/s) | " + " | ".join(_fmt(rows[p]["ttft_p95_s"]) for p in POLICIES)
                         + " |")
    lines += ["", "### Sensitivity to rank skew (power law over ranks, 85% load): P95 TTFT (s)",
              "", "| alpha | " + " | ".join(POLICIES) + " |", rule]
    for alpha in (1 / 3, 1.0, 3.0):
        rows = {r["job"]["policy"]: r for r in by("alpha")
                if abs(r["job"]["rank_alpha"] - alpha) < 1e-9}
        lines.append(f"| {alpha:.2g} | " + " | ".join(_fmt(rows[p]["ttft_p95_s"])
                                                       for p in POLICIES) + " |")
    eng = by("engines")
    lines += ["", f"### Engines needed for {eng[0]['job']['rate']:.0f} req/s (shifting skew, "
              "Poisson) within the SLO", "",
              "| policy | engines needed | P95 TTFT at that size (s) |", "|---|---|---|"]
    for pol in POLICIES:
        rows = sorted((r for r in eng if r["job"]["policy"] == pol),
                      key=lambda r: r["job"]["engines"])
        fit = [r for r in rows if r["ttft_p95_s"] <= st.slo_ttft_p95_s]
        lines.append(f"| {pol} | " + (f"{fit[0]['job']['engines']} | "
                                      f"{fit[0]['ttft_p95_s']:.2f} |" if fit
                                      else f"> {rows[-1]['job']['engines']} | - |"))
    return lines + [""]


def write_report(results: list[dict], profile: Profile, st: Settings, path: str,
                 command: str, wall_s: float) -> None:
    base = os.path.splitext(path)[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = [
        "# Cluster simulation: placement policies on LoRAServe's traces",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} in {wall_s / 60:.1f} min "
        f"({os.cpu_count()} CPU cores). Raw results: `{os.path.basename(base)}.json`.",
        "",
        "## Setup",
        f"- **Step model:** `{profile.source}`: {dict(profile.step.coef)}. It is run once "
        "costed as MBGMV and once as BGMV; the sections below give each.",
        f"- **Engine:** token budget {profile.max_batched_tokens}, "
        f"{profile.max_num_seqs} requests. The remaining engine parameters are the simulator's "
        "defaults (perf/engine.py): 200k KV tokens; 8 GB of device memory for adapters; "
        f"host-to-device {profile.host_to_device_bytes_per_s / 1e9:.0f} GB/s; remote fetch "
        f"{profile.remote_fetch_bytes_per_s / 1e9:.0f} GB/s; "
        f"{profile.adapter_bytes_per_rank / 1e6:.0f} MB per rank.",
        f"- **Operating points:** tokens/s per engine within a P95 TTFT of "
        f"{profile.slo['ttft_p95_s']} s, found by simulating one engine at 512/128 tokens (a "
        "single rank pads nothing, so they are the same for both kernels): "
        + ", ".join(f"r{r}: {v:.0f}" for r, v in sorted(profile.operating_points.items()))
        + ".",
        f"- **Traces:** `loraserve bench gen --kind loraserve`, {st.duration_s:.0f} s per run, "
        "with lengths drawn from the bundled Azure conversation trace (2023, CC-BY). Adapters "
        f"within a rank follow a power law (alpha 1). Seed {st.seed}.",
        f"- **Router:** placement recomputed every {st.rebalance_s:.0f} s from demand "
        "estimated with Holt smoothing (cluster/demand.py), with migration that fetches "
        "before it switches routing. Every policy starts from the demand of the trace's "
        f"first {st.rebalance_s:.0f} s; only loraserve uses it.",
        "  - `toppings` keeps every adapter on every engine and routes each request by its "
        "cost score (TBT SLO 0.1 s).",
        "  - `random` and `contiguous` are static.",
        f"- **SLO:** P95 TTFT <= {st.slo_ttft_p95_s:.0f} s. A run stops at "
        f"{3 * st.duration_s:.0f} s of simulated time; unfinished requests count as infinitely "
        "late (`timeout`).",
        "- **Rates:** fractions of an estimated capacity, computed from the operating points "
        "and the trace's mean request length.",
        "",
    ]
    for kind in KINDS:
        lines += _kind_section([r for r in results if r["job"]["kind"] == kind], kind, st,
                               base)
    lines += ["## Caveats",
              "- This is a simulation with a linear step model. It is not a measurement of "
              "engines.",
              "- Unless the profile above is a measured one, the step model is the documented "
              "illustrative default (`perf.model.default_profile`). The ranking of the "
              "policies is the result to read, not the absolute latencies.",
              "- Regenerate it with a measured profile: `loraserve profile ...`, then "
              "`loraserve bench simulate --report ... --profile PROFILE.json`.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(base + ".json", "w") as f:
        json.dump({"settings": asdict(st), "profile": profile.to_json(), "results": results},
                  f, indent=1)


def run_report(profile: Profile, path: str, command: str, workers: int | None = None,
               quick: bool = False, settings: Settings | None = None) -> None:
    from tqdm import tqdm

    st = settings or Settings(duration_s=120.0 if quick else 240.0)
    todo = jobs(profile, quick)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        results = list(tqdm(pool.map(run_job, [(j, profile.to_json(), st) for j in todo]),
                            total=len(todo), desc="simulations"))
    write_report(results, profile, st, path, command, time.perf_counter() - t0)
