"""The router's state and decisions (LoRAServe §IV): routing table, adapter
table, demand, placement, migration, health.

- routing table: adapter -> [(engine, phi)], requests drawn by phi
  (cluster/routing.py); `toppings` routes by cost score instead;
- adapter table (`holders`): adapter -> engines whose store and vLLM hold it;
- every `rebalance_s`: close the demand window, place with the previous
  assignment as a hint, then migrate: ensure every new (adapter, engine)
  pair (fetch from a live holder over the transport, else from the source,
  then load into vLLM), switch routing, and only then drain and unload the
  pairs that left (unload frees the worker's memory too);
- distributed pool (§IV-B): a request for an adapter no live engine holds
  (its holders died, or loading failed) makes the least loaded live engine
  fetch it, from a peer over the transport or from the source, and routes
  there;
- health: an engine that fails its check leaves routing at once, requests in
  flight on it are told (`down_signal`: the proxy retries them elsewhere if
  nothing reached the client yet), and its adapters are placed again over
  the live engines (fetched from peers, or the source for those only it
  held); it is restarted (`restart_attempts` times) and rejoins the
  placement once it passes its check again. A request that cannot reach an
  engine counts as one failed check and checks it now. Each phase is timed
  (cluster/faults.py).

Invariants: routing only names engines in `holders` for that adapter (pairs
are ensured before a switch and unloaded after one); every known adapter has
a routing entry while any engine is alive. Placements are applied under one
lock, and a drain decides to unload under it too, so it never unloads a pair
that a placement being applied still routes to; an ensure of a pair waits for
that pair's running unload.

`RouterCore` knows engines only through `EngineHandle`, so it runs under Ray
(launch.py) and in unit tests with fakes alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from vllm_loraserve.adapters.safety import (
    alias_of,
    check_name,
    check_not_alias,
    newest_version,
    version_order,
)
from vllm_loraserve.cluster import migration
from vllm_loraserve.cluster.demand import DemandTracker
from vllm_loraserve.cluster.engine import AdapterRejected
from vllm_loraserve.cluster.faults import FaultLog
from vllm_loraserve.cluster.placement import Assignment, get_policy
from vllm_loraserve.cluster.placement.toppings import EngineView, ToppingsRouter
from vllm_loraserve.cluster.routing import RoutingTable
from vllm_loraserve.perf.model import Profile
from vllm_loraserve.perf.operating import with_operating_points

logger = logging.getLogger(f"vllm.{__name__}")


class NameTaken(ValueError):
    """A registration under a name already registered (HTTP 409)."""


class EngineHandle(Protocol):
    """`url`, `pid` and `transport_address` describe the engine's current
    server process; `health()` refreshes them (a restart changes them)."""

    index: int
    url: str
    pid: int | None
    transport_address: str

    async def health(self) -> bool: ...
    async def load(self, adapter: str) -> None: ...
    async def unload(self, adapter: str) -> None: ...
    async def fetch_from_peer(self, address: str, adapter: str) -> dict: ...
    async def fetch_from_source(self, adapter: str) -> dict: ...
    async def restart(self) -> dict: ...


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "loraserve"
    rebalance_s: float | None = 30.0  # None: placement only at start and on faults
    health_interval_s: float = 2.0
    health_failures: int = 2  # consecutive failed checks that take an engine down
    drain_timeout_s: float = 120.0  # then unload anyway
    tbt_slo_s: float = 0.1  # toppings' decode-latency SLO
    restart_attempts: int = 3  # per failure of an engine; 0: leave dead engines down
    restart_backoff_s: float = 5.0
    seed: int = 0


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = PromCounter("loraserve_router_requests", "Requests by outcome.",
                                    ["adapter", "engine", "status"], registry=r)
        self.inflight = Gauge("loraserve_router_engine_inflight",
                              "Requests in flight per engine (its load).", ["engine"], registry=r)
        self.engine_up = Gauge("loraserve_router_engine_up", "1 if the engine passes its "
                               "health check.", ["engine"], registry=r)
        self.demand = Gauge("loraserve_router_adapter_demand_tokens_per_second",
                            "Estimated demand per adapter.", ["adapter"], registry=r)
        self.phi = Gauge("loraserve_router_placement_phi", "Routing share of each "
                         "(adapter, engine) pair.", ["adapter", "engine"], registry=r)
        self.migrations = PromCounter("loraserve_router_migrations",
                                      "(adapter, engine) pairs added by placement.", registry=r)
        self.fetches = PromCounter("loraserve_router_fetches", "Adapter fetches by source "
                                   "(peer engine or registry).", ["source"], registry=r)
        self.fetch_bytes = PromCounter("loraserve_router_fetch_bytes", "Adapter bytes "
                                       "fetched, by source.", ["source"], registry=r)
        self.fetch_seconds = Histogram("loraserve_router_fetch_seconds", "Adapter fetch "
                                       "latency.", ["source"], registry=r,
                                       buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.peer_fetches = PromCounter("loraserve_router_peer_fetches", "Adapter fetches "
                                        "from a peer engine, by the transport that moved "
                                        "them (nixl falls back to tcp).", ["transport"],
                                        registry=r)
        self.retries = PromCounter("loraserve_router_retries", "Requests retried on another "
                                   "engine before any token was sent.", registry=r)


class RouterCore:
    def __init__(self, engines: Mapping[int, EngineHandle], catalog: Mapping[str, int],
                 base_model: str, profile: Profile, config: RouterConfig) -> None:
        self.engines = dict(engines)
        self.catalog: dict[str, int] = {}  # adapter -> rank, the adapters being served
        self.invalid: dict[str, str] = {}  # adapter -> why no engine can serve it
        # In version order, as if registered oldest first (`x@500` before `x@1000`):
        # an alias names the last registered version left.
        for a, rank in sorted(catalog.items(), key=lambda item: version_order(item[0])):
            # `base@1` in the source must not take over `base`
            try:
                check_name(a, reserved={base_model})
                self.catalog[a] = rank
            except ValueError as e:
                self.invalid[a] = str(e)
        # name -> its newest published version name@version (`resolve`)
        self.aliases = {alias_of(a): a for a in self.catalog if alias_of(a) != a}
        self.base_model = base_model
        self.profile, self.config = profile, config
        self.policy = get_policy(config.policy, config.seed)
        self.toppings = (ToppingsRouter(profile.step, config.tbt_slo_s, 128.0)
                         if config.policy == "toppings" else None)
        self.demand = DemandTracker(config.rebalance_s or 60.0)
        self.metrics = RouterMetrics()
        self.faults = FaultLog(self.metrics.registry)
        self.alive: set[int] = set()
        self.holders: dict[str, set[int]] = {a: set() for a in self.catalog}
        self.assignment: Assignment = {}
        self.routing = RoutingTable({})
        self.inflight: Counter[int] = Counter()
        self.inflight_pairs: Counter[tuple[str, int]] = Counter()
        self._inflight_ranks: dict[int, Counter[int]] = {e: Counter() for e in self.engines}
        self._ensuring: dict[tuple[str, int], asyncio.Task] = {}
        self._unloading: dict[tuple[str, int], asyncio.Task] = {}
        self._placement_lock = asyncio.Lock()
        self._rng = np.random.default_rng(config.seed)
        self._background: set[asyncio.Task] = set()
        self._restarting: set[int] = set()
        self._failures: Counter[int] = Counter()
        self._first_sign: dict[int, float] = {}  # engine -> first failure since it was ok
        self._down: dict[int, asyncio.Event] = {}  # set when the engine leaves routing
        self.down_reason: dict[int, str] = {}
        self._window_start = time.monotonic()

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        for e in self.engines:
            await self._check(e)
        if not self.alive:
            raise RuntimeError("no engine passed its health check")
        async with self._placement_lock:
            await self._apply(self._place(None))

    async def run(self) -> None:
        """Health checks and periodic rebalancing, until cancelled."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                for e in list(self.engines):
                    await self._check(e)
                if (self.config.rebalance_s
                        and time.monotonic() - last >= self.config.rebalance_s):
                    last = time.monotonic()
                    await self.rebalance()
            except Exception:  # one bad tick must not end health checks for good
                logger.exception("router tick failed; next tick in %ss",
                                 self.config.health_interval_s)

    async def settle(self) -> None:
        """Wait for background work (drains, unloads, checks, restarts) to end."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- placement -----------------------------------------------------------
    def live(self) -> list[int]:
        return sorted(self.alive)

    def _place(self, demand: Mapping[str, float] | None) -> Assignment:
        """The policy's placement over the live engines; `demand` None (or
        empty): nothing measured yet, a cold placement."""
        return migration.place(self.policy, self.catalog, demand, self.live(), self.assignment,
                               self.profile.operating_points,
                               padded=self.profile.step.kind == "bgmv")

    async def rebalance(self) -> int:
        """Close the demand window and move to a new placement; returns the
        number of (adapter, engine) pairs added."""
        async with self._placement_lock:
            now = time.monotonic()
            self.demand.roll(now - self._window_start)
            self._window_start = now
            estimate = self.demand.estimate()
            for a in self.catalog:
                self.metrics.demand.labels(a).set(estimate.get(a, 0.0))
            if not self.alive:
                return 0
            return await self._apply(self._place(estimate))

    async def set_placement(self, assignment: Assignment) -> int:
        """Apply an operator's placement (validated by the caller)."""
        async with self._placement_lock:
            return await self._apply(assignment)

    async def _apply(self, new: Assignment) -> int:
        """Ensure new pairs, switch routing, then drain and unload old pairs
        (cluster/migration.py decides each)."""
        added = migration.to_ensure(new, self.holders)
        results = await asyncio.gather(*(self.ensure(a, e) for a, e in added),
                                       return_exceptions=True)
        failed = {pair for pair, r in zip(added, results, strict=True)
                  if isinstance(r, Exception)}
        for (a, e), r in zip(added, results, strict=True):
            if isinstance(r, AdapterRejected):
                self._reject(a, str(r))
            elif isinstance(r, Exception):
                logger.error("could not place adapter %s on engine %s: %s", a, e, r)
        # Holders as they are now: failed loads, and drains that ended during
        # the loads, are not routed to.
        routed = migration.route(new, self.holders, self.assignment, self.catalog)
        self.assignment = routed
        self.routing = RoutingTable(routed)
        self.metrics.migrations.inc(len(added) - len(failed))
        self.metrics.phi.clear()
        for a, entries in routed.items():
            for e, p in entries:
                self.metrics.phi.labels(a, str(e)).set(p)
        for a, e in migration.to_unload(routed, self.holders):
            self._spawn(self._drain_and_unload(a, e))
        return len(added) - len(failed)

    async def ensure(self, adapter: str, engine: int) -> None:
        """Make `engine` hold `adapter` (one attempt at a time per pair)."""
        key = (adapter, engine)
        if key in self._unloading:  # let a running unload of this pair end first
            await asyncio.wait([self._unloading[key]])
        if engine in self.holders[adapter]:
            return
        task = self._ensuring.get(key)
        if task is None:
            task = self._ensuring[key] = asyncio.create_task(self._fetch_and_load(adapter, engine))
            task.add_done_callback(lambda t: (self._ensuring.pop(key, None),
                                              t.cancelled() or t.exception()))
        # Shared by a placement round and requests: a client that leaves must not cancel it.
        await asyncio.shield(task)

    async def _fetch_and_load(self, adapter: str, engine: int) -> None:
        handle = self.engines[engine]
        peers = sorted(e for e in self.holders[adapter] if e in self.alive and e != engine)
        info = None
        if peers:
            source = "peer"
            try:
                info = await handle.fetch_from_peer(self.engines[peers[0]].transport_address,
                                                    adapter)
            except Exception as e:  # the registry still has it
                logger.warning("fetching %s from engine %s failed (%s); using the registry",
                               adapter, peers[0], e)
        if info is None:
            source = "registry"
            info = await handle.fetch_from_source(adapter)
        self.metrics.fetches.labels(source).inc()
        if source == "peer":
            self.metrics.peer_fetches.labels(info.get("via", "unknown")).inc()
        self.metrics.fetch_bytes.labels(source).inc(info["bytes"])
        self.metrics.fetch_seconds.labels(source).observe(info["seconds"])
        await handle.load(adapter)
        self.holders[adapter].add(engine)

    def _reject(self, adapter: str, reason: str) -> None:
        """Stop serving an adapter an engine refused (its copies elsewhere drain
        and unload with the next `_apply`)."""
        if adapter in self.catalog:
            logger.error("adapter %s cannot be served: %s", adapter, reason)
            self.catalog.pop(adapter)
            self._repoint_alias(adapter)
            self.invalid[adapter] = reason

    async def _drain_and_unload(self, adapter: str, engine: int) -> None:
        key = (adapter, engine)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.inflight_pairs[key] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        # Under the lock, so no placement is half applied: one that put the
        # pair back is seen here, and none starts routing to it from now on.
        async with self._placement_lock:
            if (engine in {e for e, _ in self.assignment.get(adapter, [])}
                    or engine not in self.holders.get(adapter, ()) or key in self._unloading):
                return  # placed here again meanwhile, or already gone
            self.holders[adapter].discard(engine)
            if engine not in self.alive:
                return
            task = self._unloading[key] = asyncio.create_task(
                self.engines[engine].unload(adapter))
        try:
            await task
        except Exception as e:  # still held as far as we know: the next placement retries
            logger.warning("unloading %s from engine %s failed: %s", adapter, engine, e)
            if engine in self.alive and adapter in self.holders:
                self.holders[adapter].add(engine)
        finally:
            self._unloading.pop(key, None)

    # -- health --------------------------------------------------------------
    async def _check(self, engine: int) -> None:
        try:
            ok = await asyncio.wait_for(self.engines[engine].health(), timeout=10.0)
        except Exception:
            ok = False
        self.metrics.engine_up.labels(str(engine)).set(1 if ok else 0)
        self._failures[engine] = 0 if ok else self._failures[engine] + 1
        if ok:
            self._first_sign.pop(engine, None)
        else:
            self._first_sign.setdefault(engine, time.monotonic())
        if ok and engine not in self.alive:
            await self._engine_up(engine)
        elif (not ok and engine in self.alive
              and self._failures[engine] >= self.config.health_failures):
            await self._engine_down(engine)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def down_signal(self, engine: int) -> asyncio.Event:
        """Set when `engine` leaves routing (then `down_reason[engine]` says
        why), and already set if it is out; a request in flight on it waits
        on this too."""
        if engine not in self.alive:  # left while the request was being routed
            down = asyncio.Event()
            down.set()
            return down
        return self._down.setdefault(engine, asyncio.Event())

    async def _engine_down(self, engine: int, why: str = "failed its health check") -> None:
        if engine not in self.alive:
            return  # another check got here first
        # Out of routing before waiting for the lock: a placement being
        # applied may hold it for long, and no new request may go there.
        logger.error("engine %s %s: taken out of routing", engine, why)
        self.alive.discard(engine)
        self.down_reason[engine] = why
        self._down.pop(engine, asyncio.Event()).set()
        held = [a for a, hs in self.holders.items() if engine in hs]
        fault = self.faults.down(engine, why, held, self._first_sign.pop(engine, None))
        async with self._placement_lock:
            for holders in self.holders.values():
                holders.discard(engine)
            only_here = [a for a in held if not self.holders[a] & self.alive]
            t0 = time.monotonic()
            if self.alive:
                await self._apply(self._place(self.demand.estimate()))
            self.faults.replaced(fault, time.monotonic() - t0,
                                 {a: sorted(self.holders.get(a, set()) & self.alive)
                                  for a in sorted(held) if a in self.catalog}, only_here)
        if self.config.restart_attempts and engine not in self._restarting:
            self._spawn(self._restart(engine))

    async def _restart(self, engine: int) -> None:
        self._restarting.add(engine)
        try:
            for attempt in range(1, self.config.restart_attempts + 1):
                logger.info("restarting engine %s (attempt %d)", engine, attempt)
                try:
                    await self.engines[engine].restart()
                except Exception as e:
                    logger.error("engine %s did not restart: %s", engine, e)
                    await asyncio.sleep(self.config.restart_backoff_s)
                    continue
                await self._check(engine)
                if engine in self.alive:
                    return
            logger.error("engine %s stays down after %d restarts", engine,
                         self.config.restart_attempts)
        finally:
            self._restarting.discard(engine)

    async def _engine_up(self, engine: int) -> None:
        async with self._placement_lock:
            if engine in self.alive:
                return
            logger.info("engine %s is healthy: it joins the placement", engine)
            self.alive.add(engine)
            self.down_reason.pop(engine, None)
            fault = self.faults.up(engine)
            for holders in self.holders.values():  # a (re)started server holds nothing
                holders.discard(engine)
            t0 = time.monotonic()
            if self.assignment:
                await self._apply(self._place(self.demand.estimate()))
            if fault is not None:
                self.faults.given(fault, time.monotonic() - t0,
                                  [a for a, hs in self.holders.items() if engine in hs])

    # -- requests ------------------------------------------------------------
    def resolve(self, model: str) -> str:
        """The adapter a request's `model` names: itself, or for the alias
        `name` of published versions `name@version`, the newest registered
        one (at start-up, the highest version), never a refused one (an
        adapter registered as plain `name` keeps its name)."""
        return model if model in self.catalog else self.aliases.get(model, model)

    def choose(self, model: str, exclude: Collection[int] = ()) -> int | None:
        """The engine for a request, or None if no live engine can take it."""
        skip = set(exclude) | (set(self.engines) - self.alive)
        if model not in self.catalog:  # the base model: the least loaded engine
            live = [e for e in self.live() if e not in skip]
            return min(live, key=lambda e: (self.inflight[e], e)) if live else None
        # Routed and holding it now: a route may outlive a copy (a restarted
        # engine holds nothing; a placement whose loads all failed keeps the old
        # route), and then `acquire` fetches it instead.
        skip |= set(self.engines) - self.holders.get(model, set())
        holders = [e for e in self.routing.engines(model) if e not in skip]
        if self.toppings is not None and holders:
            views = {e: EngineView(running=self.inflight[e],
                                   running_rank_sum=sum(r * n for r, n in
                                                        self._inflight_ranks[e].items()),
                                   running_rank_max=max(self._inflight_ranks[e], default=0))
                     for e in holders}
            return self.toppings.route(self.catalog[model], 0, holders, views)
        return self.routing.pick(model, float(self._rng.random()), skip) if holders else None

    async def acquire(self, model: str, exclude: Collection[int] = ()) -> int | None:
        """`choose`, and when no live engine holds the adapter, fetch it onto the
        least loaded live engine and route it there."""
        engine = self.choose(model, exclude)
        if engine is not None or model not in self.catalog:
            return engine
        live = [e for e in self.live() if e not in exclude]
        if not live:
            return None
        target = min(live, key=lambda e: (self.inflight[e], e))
        try:
            await self.ensure(model, target)
        except AdapterRejected as e:
            self._reject(model, str(e))
            return None
        except Exception as e:
            logger.error("could not fetch adapter %s onto engine %s: %s", model, target, e)
            return None
        if model not in self.catalog:  # unregistered (or rejected) during the fetch
            self._spawn(self._drain_and_unload(model, target))
            return None
        # Between two awaits nothing else runs: the entry is read and written at once.
        kept = [(e, p) for e, p in self.assignment.get(model, [])
                if e in self.alive and e in self.holders[model] and e != target]
        share = 1.0 / (len(kept) + 1)
        self.assignment[model] = [(e, p * (1 - share) / (sum(q for _, q in kept) or 1.0))
                                  for e, p in kept] + [(target, share)]
        self.routing = RoutingTable(self.assignment)
        return target

    def begin(self, model: str, engine: int) -> int:
        """Count a request in flight; returns its rank (0: base model), which
        `end` takes back (the catalog may change meanwhile)."""
        rank = self.catalog.get(model, 0)
        self.inflight[engine] += 1
        self.inflight_pairs[(model, engine)] += 1
        if rank:
            self._inflight_ranks[engine][rank] += 1
        self.metrics.inflight.labels(str(engine)).set(self.inflight[engine])
        return rank

    def end(self, model: str, engine: int, status: str, tokens: int, rank: int) -> None:
        """Exactly once per `begin`."""
        self.inflight[engine] -= 1
        self.inflight_pairs[(model, engine)] -= 1
        if rank:
            ranks = self._inflight_ranks[engine]
            ranks[rank] -= 1
            if ranks[rank] <= 0:
                del ranks[rank]
        if tokens and model in self.catalog:
            self.demand.record(model, tokens)
        if status == "ok":
            self.faults.served(model, engine)
        self.metrics.inflight.labels(str(engine)).set(self.inflight[engine])
        self.metrics.requests.labels(model, str(engine), status).inc()

    async def check_now(self, engine: int) -> None:
        await self._check(engine)

    async def restart_engine(self, engine: int) -> dict:
        """An operator's restart: out of routing first (its adapters placed on
        the others), then a fresh server, which rejoins once healthy."""
        self._restarting.add(engine)  # no automatic restart races this one
        try:
            await self._engine_down(engine, "restarts on request")
            info = await self.engines[engine].restart()
            await self._check(engine)
            return info
        finally:
            self._restarting.discard(engine)
            if engine not in self.alive and self.config.restart_attempts:
                self._spawn(self._restart(engine))  # it failed: the automatic restarts go on

    def suspect(self, engine: int) -> None:
        """A request could not reach `engine`: that counts as a failed check (so
        one more failed check takes it down at once), and it is checked now,
        not at the next tick. A request alone never takes an engine down."""
        self._first_sign.setdefault(engine, time.monotonic())
        self._failures[engine] = max(self._failures[engine], self.config.health_failures - 1)
        self._spawn(self._check(engine))

    # -- admin ---------------------------------------------------------------
    def check_new_name(self, adapter: str) -> None:
        """NameTaken if `adapter` is registered; ValueError if it is the alias
        of registered versions (the alias rule, adapters/safety.py)."""
        if adapter in self.catalog:
            raise NameTaken(f"adapter `{adapter}` is already registered")
        check_not_alias(adapter, self.aliases.get(adapter))

    async def register(self, adapter: str, rank: int) -> None:
        """Serve a new adapter (`check_new_name` first, under the lock: a
        concurrent registration may have taken the name); if an engine
        refuses it, it ends in `invalid`."""
        async with self._placement_lock:
            self.check_new_name(adapter)
            if rank not in self.profile.operating_points:  # placement needs its capacity
                self.profile = await asyncio.to_thread(with_operating_points, self.profile,
                                                       [rank])
            self.invalid.pop(adapter, None)
            self.catalog[adapter] = rank
            alias = alias_of(adapter)
            if alias != adapter:  # a published version (train/publish.py): the newest
                self.aliases[alias] = adapter
            self.holders.setdefault(adapter, set())
            live = self.live()
            if live:  # placed with a share at once; rebalancing refines it
                target = min(live, key=lambda e: (self.inflight[e], e))
                await self._apply({**self.assignment, adapter: [(target, 1.0)]})

    async def unregister(self, adapter: str) -> None:
        async with self._placement_lock:
            self.catalog.pop(adapter, None)
            self._repoint_alias(adapter)
            # its pairs drain and unload like any pair that left the placement
            await self._apply({a: v for a, v in self.assignment.items() if a != adapter})

    def _repoint_alias(self, gone: str) -> None:
        """`gone` left the catalogue: its alias names the newest version left, or goes."""
        alias = alias_of(gone)
        if self.aliases.get(alias) == gone:
            newest = newest_version(alias, self.catalog)  # the catalogue is oldest first
            if newest is not None:
                self.aliases[alias] = newest
            else:
                del self.aliases[alias]

    def status(self) -> dict:
        return {
            "policy": self.config.policy, "alive": self.live(),
            "engines": {e: {"url": h.url, "pid": h.pid, "alive": e in self.alive,
                            "inflight": self.inflight[e],
                            "adapters": sorted(a for a, hs in self.holders.items() if e in hs)}
                        for e, h in self.engines.items()},
            "placement": {a: [[e, p] for e, p in v] for a, v in sorted(self.assignment.items())},
        }
