"""Discrete-event simulation of K engines (perf/engine.py) behind a router.

The router's logic is the router's own code: the placement policies
(cluster/placement), the routing table (requests go to an engine drawn with
the adapter's phi, or, for `toppings`, to the engine with the lowest cost
score), the demand tracker, and the migration planner (cluster/migration.py).
Every `rebalance_s` the router closes a demand window, places with the
previous assignment as a hint, and migrates as the router does: each pair the
planner says to ensure is fetched, routing switches once all those fetches
are done (no request goes to an engine before its adapter has arrived), and
the pairs routing left are drained (their requests here finish) and then
unloaded from the engine's host and device memory. Unlike the router, a
drain has no timeout. The initial placement assumes equal demand for every
adapter, or (`warm_start_s`) the demand of the trace's first seconds.

Engines start with their initially placed adapters in host memory; a request
for an adapter an engine does not hold makes it fetch the adapter first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.cluster import migration
from vllm_loraserve.cluster.demand import DemandTracker
from vllm_loraserve.cluster.placement import Assignment, get_policy
from vllm_loraserve.cluster.placement.toppings import EngineView, ToppingsRouter
from vllm_loraserve.cluster.routing import RoutingTable
from vllm_loraserve.perf.engine import EngineConfig, SimEngine, SimRequest
from vllm_loraserve.perf.model import Profile
from vllm_loraserve.workloads.trace import Request

_ARRIVAL, _STEP_DONE, _FETCHED, _REBALANCE, _SWITCH = range(5)


@dataclass(frozen=True)
class ClusterConfig:
    num_engines: int
    policy: str = "loraserve"
    rebalance_s: float | None = 30.0  # None: never rebalance
    engine: EngineConfig = field(default_factory=EngineConfig)
    tbt_slo_s: float = 0.1  # Toppings' decode-latency SLO (its penalty threshold)
    # Initial placement: equal demand for every adapter (0), or the demand of
    # the trace's first `warm_start_s` seconds, as a router running before the
    # trace began would have measured it.
    warm_start_s: float = 0.0
    seed: int = 0
    max_time_s: float | None = None  # stop here (unfinished requests count as timed out)


@dataclass
class SimResult:
    requests: list[SimRequest]
    engines: list[SimEngine]
    migrations: int  # (adapter, engine) pairs added by rebalancing
    rebalances: int
    on_demand_fetches: int  # fetches a request had to wait for
    end_time: float
    rejected: list[Request]
    assignment: Assignment  # the routing at the end

    def finished(self) -> list[SimRequest]:
        return [r for r in self.requests if r.finish >= 0]

    def ttft(self) -> np.ndarray:
        return np.array([r.first_token - r.req.arrival_s for r in self.requests
                         if r.first_token >= 0])

    def tpot(self) -> np.ndarray:
        return np.array([(r.finish - r.first_token) / (r.req.output_len - 1)
                         for r in self.requests if r.finish >= 0 and r.req.output_len > 1])

    def summary(self, ttft_slo_s: float | None = None) -> dict:
        """Latency percentiles over all requests; unfinished ones (timed out)
        count as infinitely late."""
        n = len(self.requests) + len(self.rejected)
        ttft = np.concatenate([self.ttft(), np.full(n - len(self.ttft()), np.inf)])
        done = self.finished()
        span = max(self.end_time, 1e-9)
        out = {
            "requests": n, "finished": len(done), "rejected": len(self.rejected),
            "ttft_mean_s": float(np.mean(self.ttft())) if len(self.ttft()) else float("inf"),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p95_s": float(np.percentile(ttft, 95)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_mean_s": float(np.mean(self.tpot())) if len(self.tpot()) else float("nan"),
            "throughput_req_s": len(done) / span,
            "throughput_tok_s": sum(r.req.prompt_len + r.req.output_len for r in done) / span,
            "engine_ttft_p95_s": [self._engine_p95(e.index) for e in self.engines],
            "engine_busy_frac": [e.busy_time / span for e in self.engines],
            "engine_adapters_seen": [len(e.adapters_seen) for e in self.engines],
            "fetches": sum(e.fetches for e in self.engines),
            "on_demand_fetches": self.on_demand_fetches,
            "device_loads": sum(e.device_loads for e in self.engines),
            "migrations": self.migrations, "rebalances": self.rebalances,
        }
        if ttft_slo_s is not None:
            out["ttft_slo_attainment"] = float(np.mean(ttft <= ttft_slo_s))
        return out

    def _engine_p95(self, index: int) -> float:
        t = [r.first_token - r.req.arrival_s if r.first_token >= 0 else np.inf
             for r in self.requests if r.engine == index]
        return float(np.percentile(t, 95)) if t else 0.0


def _view(e: SimEngine) -> EngineView:
    return EngineView(
        running=len(e.running), running_rank_sum=e.running_rank_sum,
        running_rank_max=max(e.running_ranks, default=0), queued=len(e.waiting),
        queued_rank_sum=e.queued_rank_sum, queued_rank_max=max(e.queued_ranks, default=0),
        queued_prompt_tokens=e.queued_prompt_tokens, queued_prompt_lora=e.queued_prompt_lora)


def simulate(trace: Sequence[Request], catalog: Sequence[AdapterRecord], profile: Profile,
             config: ClusterConfig) -> SimResult:
    """Run the trace to completion (or `max_time_s`) and return what happened."""
    if not profile.operating_points:
        raise ValueError("the profile has no operating points: compute them first "
                         "(perf.operating.with_operating_points)")
    k = config.num_engines
    engines = [SimEngine(i, profile, config.engine) for i in range(k)]
    rank_of = {a.name: a.rank for a in catalog}
    policy = get_policy(config.policy, config.seed)
    ops = profile.operating_points
    initial = None  # a cold placement
    if config.warm_start_s > 0:
        initial = dict.fromkeys(rank_of, 0.0)
        for req in trace:
            if req.arrival_s > config.warm_start_s:
                break
            initial[req.adapter] += (req.prompt_len + req.output_len) / config.warm_start_s
    padded = profile.step.kind == "bgmv"
    ids = list(range(k))
    assignment = migration.place(policy, rank_of, initial, ids, {}, ops, padded)
    holders = {name: {s for s, _ in entries} for name, entries in assignment.items()}
    for name, entries in assignment.items():
        for s, _ in entries:
            engines[s].preload(name, rank_of[name])
    draining: set[tuple[str, int]] = set()
    table = RoutingTable(assignment)
    toppings = (ToppingsRouter(profile.step, config.tbt_slo_s,
                               float(np.mean([r.output_len for r in trace])) if trace else 1.0)
                if config.policy == "toppings" else None)
    demand = DemandTracker(config.rebalance_s or 1.0)
    rng = np.random.default_rng(config.seed)

    events: list = []
    seq = itertools.count()

    def push(t: float, kind: int, data) -> None:
        heapq.heappush(events, (t, next(seq), kind, data))

    for i, req in enumerate(trace):
        push(req.arrival_s, _ARRIVAL, i)
    if config.rebalance_s and trace:
        push(config.rebalance_s, _REBALANCE, None)

    states = [SimRequest(r) for r in trace]
    rejected: list[Request] = []
    migrations = rebalances = on_demand_fetches = 0
    remaining = len(trace)
    now = 0.0

    def unload_if_drained(name: str, s: int) -> None:
        """The router's drain: unload once no request here uses the adapter,
        unless routing names the pair again by then."""
        if engines[s].in_use[name]:
            draining.add((name, s))
            return
        draining.discard((name, s))
        if s not in table.engines(name):
            holders[name].discard(s)
            engines[s].unload(name)

    def kick(e: SimEngine, t: float) -> None:
        end = e.start_step(t)
        if end is not None:
            push(end, _STEP_DONE, e.index)

    while events and remaining:
        now, _, kind, data = heapq.heappop(events)
        if config.max_time_s is not None and now > config.max_time_s:
            now = config.max_time_s
            break
        if kind == _ARRIVAL:
            r = states[data]
            req = r.req
            if req.prompt_len + req.output_len > config.engine.kv_capacity_tokens:
                rejected.append(req)  # can never fit an engine's KV cache
                remaining -= 1
                continue
            demand.record(req.adapter, req.prompt_len + req.output_len)
            if toppings is not None:
                s = toppings.route(req.rank, req.prompt_len, table.engines(req.adapter),
                                   {i: _view(engines[i]) for i in table.engines(req.adapter)})
            else:
                s = table.pick(req.adapter, rng.random())
            e = engines[s]
            e.enqueue(r)
            if not e.has_host(req.adapter):
                on_demand_fetches += req.adapter not in e.fetch_ready
                push(e.fetch(req.adapter, req.rank, now), _FETCHED, (s, req.adapter))
            kick(e, now)
        elif kind == _STEP_DONE:
            e = engines[data]
            done = e.end_step(now)
            remaining -= len(done)
            for name in {r.req.adapter for r in done}:
                if (name, e.index) in draining:
                    unload_if_drained(name, e.index)
            kick(e, now)
        elif kind == _FETCHED:
            s, adapter = data
            engines[s].fetched(adapter, rank_of[adapter])
            kick(engines[s], now)
        elif kind == _REBALANCE:
            demand.roll()
            new = migration.place(policy, rank_of, demand.estimate(), ids, assignment, ops,
                                  padded)
            rebalances += 1
            ensure = migration.to_ensure(new, holders)
            ready = now
            for name, s in ensure:
                migrations += 1
                t = engines[s].fetch(name, rank_of[name], now)
                if t > now:
                    push(t, _FETCHED, (s, name))
                ready = max(ready, t)
            push(ready, _SWITCH, (new, ensure))
            push(now + config.rebalance_s, _REBALANCE, None)
        elif kind == _SWITCH:
            new, ensured = data
            for name, s in ensured:
                holders[name].add(s)
            assignment = migration.route(new, holders, assignment, rank_of)
            table = RoutingTable(assignment)
            for name, s in migration.to_unload(assignment, holders):
                unload_if_drained(name, s)
    return SimResult(states, engines, migrations, rebalances, on_demand_fetches, now, rejected,
                     assignment)
