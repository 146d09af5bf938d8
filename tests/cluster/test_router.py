"""RouterCore with in-memory engines: placement applied, routing only to
holders, fetch from peers before the registry, switch-then-drain-then-unload,
faults, restarts, on-demand fetch, registration and refused adapters."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter

import pytest

from tests.cluster.fakes import fake_engines
from vllm_loraserve.cluster.router import RouterConfig, RouterCore
from vllm_loraserve.perf.operating import load_profile

RANKS = (8, 16, 32, 64, 128)
CATALOG = {f"a{r}-{i}": r for r in RANKS for i in range(3)}


@functools.cache
def profile():
    return load_profile(None, set(RANKS))  # operating points take seconds to compute


def make_core(n=2, catalog=CATALOG, **config) -> tuple[RouterCore, dict, list]:
    engines, world = fake_engines(n)
    config = {"rebalance_s": None, "restart_backoff_s": 0.0, "health_failures": 1, **config}
    core = RouterCore(engines, catalog, "base", profile(), RouterConfig(**config))
    return core, engines, world


def check_invariants(core: RouterCore, engines: dict) -> None:
    """Every served adapter is routed, phi sums to 1, and routing names only
    live engines whose vLLM holds the adapter."""
    assert set(core.assignment) == set(core.catalog)
    for a, entries in core.assignment.items():
        assert entries and sum(p for _, p in entries) == pytest.approx(1.0)
        for e, _ in entries:
            assert e in core.alive and e in core.holders[a], (a, e)
            assert a in engines[e].loaded, (a, e)


def test_start_places_every_adapter_from_the_registry():
    async def body():
        core, engines, world = make_core()
        await core.start()
        check_invariants(core, engines)
        # the first copy of each adapter comes from the registry (a peer fetch
        # of a split adapter is checked by the fake: the peer must hold it)
        first = {}
        for w in world:
            if w[1] == "fetch":
                first.setdefault(w[2], w[3])
        assert first == dict.fromkeys(CATALOG, "registry")
        # each engine serves a few ranks rather than all of them (rank packing)
        for e in engines.values():
            assert 0 < len({CATALOG[a] for a in e.loaded}) < len(RANKS)
        return core
    asyncio.run(body())


def test_moved_adapter_comes_from_a_peer_and_unloads_only_after_draining():
    async def body():
        core, engines, world = make_core()
        await core.start()
        a = "a8-0"
        (src, _), = core.assignment[a]
        dst = 1 - src
        rank = core.begin(a, src)  # a request in flight on the old holder
        added = await core.set_placement({**core.assignment, a: [(dst, 1.0)]})
        assert added == 1
        assert core.routing.engines(a) == [dst]
        assert (dst, "fetch", a, f"peer-{src}") in world
        await asyncio.sleep(0.3)
        assert a in engines[src].loaded  # still draining
        core.end(a, src, "ok", 10, rank)
        await core.settle()
        assert a not in engines[src].loaded and a not in engines[src].stored
        assert world.index((dst, "load", a)) < world.index((src, "unload", a))
        check_invariants(core, engines)
        # the fakes move 1 byte a fetch: bytes moved are counted per source
        sample = core.metrics.registry.get_sample_value
        fetches = Counter(w[3][:4] for w in world if w[1] == "fetch")
        assert fetches["peer"] >= 1 and fetches["regi"] == len(CATALOG)
        assert sample("loraserve_router_fetch_bytes_total", {"source": "peer"}) == fetches["peer"]
        assert sample("loraserve_router_peer_fetches_total",
                      {"transport": "tcp"}) == fetches["peer"]
        assert sample("loraserve_router_fetch_bytes_total",
                      {"source": "registry"}) == fetches["regi"]
    asyncio.run(body())


def test_a_drain_never_unloads_a_pair_that_a_later_placement_put_back():
    """Move `a` away while a request runs on it; put it back in a placement
    that is still loading something else when that request ends."""
    async def body():
        core, engines, _ = make_core()
        await core.start()
        a = "a8-0"
        (src, _), = core.assignment[a]
        rank = core.begin(a, src)
        await core.set_placement({**core.assignment, a: [(1 - src, 1.0)]})
        b = next(x for x, v in core.assignment.items() if v == [(src, 1.0)] and x != a)
        gate = engines[1 - src].load_gates[b] = asyncio.Event()
        back = asyncio.create_task(core.set_placement(
            {**core.assignment, a: [(src, 1.0)], b: [(1 - src, 1.0)]}))
        await asyncio.sleep(0.05)  # `back` waits for b's load
        core.end(a, src, "ok", 10, rank)  # the drain of (a, src) may go on
        await asyncio.sleep(0.4)
        gate.set()
        await back
        await core.settle()
        assert core.assignment[a] == [(src, 1.0)] and a in engines[src].loaded
        check_invariants(core, engines)
    asyncio.run(body())


def test_a_source_adapter_whose_alias_is_the_base_model_is_not_served():
    core, _, _ = make_core(catalog={**CATALOG, "base@1": 8})
    assert "base@1" not in core.catalog and "base" not in core.aliases
    assert "served base model" in core.invalid["base@1"]
    assert core.resolve("base") == "base"


def test_registering_an_adapter_of_a_new_rank_keeps_placement_working():
    async def body():
        core, engines, _ = make_core()
        await core.start()
        await core.register("r4", 4)  # no operating point for rank 4 in the profile
        assert 4 in core.profile.operating_points
        await core.rebalance()
        await core.settle()
        assert "r4" in core.assignment
        check_invariants(core, engines)
    asyncio.run(body())


def test_a_failing_tick_does_not_stop_health_checks():
    async def body():
        core, engines, _ = make_core(health_interval_s=0.05)
        await core.start()
        calls = []

        async def broken_check(engine):
            calls.append(engine)
            if len(calls) == 1:
                raise RuntimeError("boom")
        core._check = broken_check
        task = asyncio.create_task(core.run())
        deadline = time.monotonic() + 30  # ticks every 0.05 s; a loaded machine is slower
        while len(calls) <= 2 and not task.done():
            assert time.monotonic() < deadline, calls
            await asyncio.sleep(0.05)
        assert not task.done() and len(calls) > 2
        task.cancel()
    asyncio.run(body())


def test_failed_load_keeps_the_old_route():
    async def body():
        core, engines, _ = make_core()
        await core.start()
        a = "a16-1"
        (src, _), = core.assignment[a]
        engines[1 - src].broken_loads.add(a)
        assert await core.set_placement({**core.assignment, a: [(1 - src, 1.0)]}) == 0
        assert core.assignment[a] == [(src, 1.0)]
        await core.settle()
        check_invariants(core, engines)
    asyncio.run(body())


def test_refused_adapter_is_no_longer_served_and_says_why():
    async def body():
        core, engines, _ = make_core()
        await core.start()
        for e in engines.values():
            e.refuse["late"] = "rank 256 is above this server's maximum LoRA rank 128"
        await core.register("late", 256)
        assert "late" not in core.catalog and "rank 256" in core.invalid["late"]
        check_invariants(core, engines)
    asyncio.run(body())


def test_dead_engine_leaves_routing_its_adapters_move_and_it_rejoins_after_restart():
    async def body():
        core, engines, world = make_core(n=3, restart_attempts=1)
        await core.start()
        victim = 0
        lost = [a for a in core.catalog if victim in core.holders[a]]
        assert lost
        engines[victim].up = False
        engines[victim].gate = gate = asyncio.Event()  # hold the restart until we looked
        await core.check_now(victim)
        assert core.live() == [1, 2]
        check_invariants(core, engines)
        gate.set()
        await core.settle()
        assert engines[victim].restarts == 1 and core.live() == [0, 1, 2]
        check_invariants(core, engines)
        # while it was down every adapter it held was served elsewhere
        moved = [w for w in world if w[1] == "load" and w[2] in lost and w[0] != victim]
        assert {w[2] for w in moved} == set(lost)
        assert any(victim in core.holders[a] for a in core.catalog)  # rejoined the placement
    asyncio.run(body())


def test_engine_left_down_when_restarts_fail():
    async def body():
        core, engines, _ = make_core(n=2, restart_attempts=2)
        await core.start()

        async def broken_restart():
            engines[1].restarts += 1
            raise RuntimeError("server exited with code 1")
        engines[1].restart = broken_restart
        engines[1].up = False
        await core.check_now(1)
        await core.settle()
        assert engines[1].restarts == 2 and core.live() == [0]
        check_invariants(core, engines)
        assert all(core.routing.engines(a) == [0] for a in core.catalog)
    asyncio.run(body())


def test_request_for_an_adapter_no_live_engine_holds_fetches_it_on_demand():
    async def body():
        core, engines, world = make_core(health_failures=99)
        await core.start()
        a = "a32-2"
        (src, _), = core.assignment[a]
        other = 1 - src
        # src refuses connections (not yet detected as down): exclude it
        got = await core.acquire(a, exclude={src})
        assert got == other and a in engines[other].loaded
        assert (other, "fetch", a, f"peer-{src}") in world
        assert other in core.routing.engines(a)
        check_invariants(core, engines)
    asyncio.run(body())


def test_routing_draws_follow_phi():
    async def body():
        core, _, _ = make_core()
        await core.start()
        a = "a64-0"
        await core.set_placement({**core.assignment, a: [(0, 0.2), (1, 0.8)]})
        counts = Counter(core.choose(a) for _ in range(4000))
        assert counts[0] / 4000 == pytest.approx(0.2, abs=0.03)
        assert core.choose(a, exclude={1}) == 0
        assert core.choose("nope") is None or core.choose("nope") in (0, 1)
    asyncio.run(body())


def test_base_model_goes_to_the_least_loaded_engine():
    async def body():
        core, _, _ = make_core()
        await core.start()
        rank = core.begin("base", 0)
        assert core.choose("base") == 1
        core.end("base", 0, "ok", 0, rank)
        assert core.inflight[0] == 0
    asyncio.run(body())


def test_rebalance_follows_demand_and_unregister_unloads_everywhere():
    async def body():
        core, engines, _ = make_core()
        await core.start()
        before = {a: list(v) for a, v in core.assignment.items()}
        for a, r in CATALOG.items():  # demand shifts to the rank-8 adapters
            core.demand.record(a, 50_000 if r == 8 else 100)
        added = await core.rebalance()
        await core.settle()
        assert added > 0 and core.assignment != before
        assert core.metrics.migrations._value.get() >= added
        check_invariants(core, engines)
        await core.unregister("a8-0")
        await core.settle()
        assert "a8-0" not in core.assignment
        assert all("a8-0" not in e.loaded for e in engines.values())
    asyncio.run(body())


def test_down_signal_is_set_when_the_engine_leaves_routing_and_fresh_after_rejoin():
    async def body():
        core, engines, _ = make_core(restart_attempts=0)
        await core.start()
        down = core.down_signal(0)
        assert not down.is_set()
        engines[0].up = False
        await core.check_now(0)
        assert down.is_set() and core.down_reason[0] == "failed its health check"
        assert core.down_signal(0).is_set()  # a request routed to it meanwhile: lost at once
        engines[0].up = True
        await core.check_now(0)
        assert not core.down_signal(0).is_set() and 0 not in core.down_reason
    asyncio.run(body())


def test_a_route_to_an_engine_that_lost_its_copy_is_not_taken():
    """One engine, dead and back: its route outlives its copies until the
    placement reloads them. A request in that window fetches its adapter
    (acquire) instead of going where vLLM would answer 404."""
    async def body():
        core, engines, _ = make_core(n=1, catalog={"a": 8, "b": 8})
        await core.start()
        engines[0].up = False
        await core.check_now(0)
        assert core.assignment["a"] == [(0, 1.0)]  # no live engine: the route stays
        engines[0].up = True
        engines[0].loaded.clear()
        engines[0].stored.clear()
        core.holders["a"].discard(0)  # as _engine_up does, before its placement
        core.alive.add(0)
        assert core.choose("a") is None
        assert await core.acquire("a") == 0 and "a" in engines[0].loaded
    asyncio.run(body())


def test_a_client_leaving_does_not_cancel_a_load_a_placement_waits_for():
    async def body():
        core, engines, _ = make_core(n=2, catalog={"a": 8}, health_failures=99)
        await core.start()
        src, dst = 0, 1
        await core.set_placement({"a": [(src, 1.0)]})
        await core.settle()
        engines[dst].load_gates["a"] = gate = asyncio.Event()
        placing = asyncio.create_task(core.set_placement({"a": [(dst, 1.0)]}))
        await asyncio.sleep(0.05)
        request = asyncio.create_task(core.ensure("a", dst))  # a request joins that load
        await asyncio.sleep(0.05)
        request.cancel()  # its client left
        await asyncio.sleep(0.05)
        gate.set()
        assert await placing == 1
        assert "a" in engines[dst].loaded and core.routing.engines("a") == [dst]
        await core.settle()
        check_invariants(core, engines)
    asyncio.run(body())


def test_an_on_demand_fetch_that_ends_after_an_unregister_is_undone():
    async def body():
        core, engines, _ = make_core(n=2, catalog={"a": 8, "b": 8}, health_failures=99)
        await core.start()
        src, other = 0, 1
        await core.set_placement({**core.assignment, "a": [(src, 1.0)]})
        await core.settle()
        engines[other].load_gates["a"] = gate = asyncio.Event()
        fetch = asyncio.create_task(core.acquire("a", exclude={src}))
        await asyncio.sleep(0.05)
        await core.unregister("a")
        gate.set()
        assert await fetch is None
        await core.settle()
        assert "a" not in core.assignment and not any("a" in e.loaded for e in engines.values())
    asyncio.run(body())


def test_a_failed_operator_restart_hands_over_to_the_automatic_ones():
    async def body():
        core, engines, _ = make_core(n=2, restart_attempts=2)
        await core.start()
        restart = engines[1].restart

        async def fails_once():
            engines[1].restart = restart
            raise RuntimeError("server exited with code 1")
        engines[1].restart = fails_once
        with pytest.raises(RuntimeError, match="exited"):
            await core.restart_engine(1)
        await core.settle()
        assert engines[1].restarts == 1 and core.live() == [0, 1]
        check_invariants(core, engines)
    asyncio.run(body())


def test_aliases_follow_version_numbers_and_leave_refused_versions():
    async def body():
        core, engines, _ = make_core(n=1, catalog={"x@1000": 8, "x@500": 8, "y@2": 8})
        assert core.resolve("x") == "x@1000"  # not the directory scan's order (x@500 last)
        await core.start()
        for e in engines.values():
            e.refuse["x@2000"] = "injected refusal"
        await core.register("x@2000", 8)
        assert "x@2000" in core.invalid and core.resolve("x") == "x@1000"
    asyncio.run(body())
