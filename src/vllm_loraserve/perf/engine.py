"""One engine under load, simulated: continuous batching with a token budget
(vLLM v1's policy), step times from a profile's step model, adapter fetch and
load costs. The per-rank operating points (operating.py) are found with one
of these alone; the cluster simulator (sim/cluster.py) runs K of them behind
the router's logic.

A step first gives one token to every decoding request, then spends the rest
of the token budget on prompt chunks: requests already prefilling first, then
waiting ones admitted in arrival order while `max_num_seqs`, the KV capacity
(a request reserves prompt + output tokens when admitted; no preemption) and
its adapter allow. A request whose adapter is not yet in this engine's host
memory is skipped until its fetch completes (remote fetch at
`remote_fetch_bytes_per_s`, one fetch at a time per engine). Admission puts
the adapter on the device if needed, which costs `bytes /
host_to_device_bytes_per_s` inside that step unless loads overlap compute
(CPU-assisted prefill). A request's first token arrives at the end of the step
that finishes its prompt; one more token arrives at the end of each later step.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from vllm_loraserve.perf.model import Profile
from vllm_loraserve.workloads.trace import Request


@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_tokens: int = 200_000  # tokens of KV cache
    host_bytes: float = 256e9  # host memory for adapters
    gpu_adapter_bytes: float = 8e9  # device memory for adapters (LRU)
    overlap_loads: bool = False  # True: device loads hidden behind compute (Toppings)


class SimRequest:
    __slots__ = ("req", "engine", "prefilled", "generated", "first_token", "finish")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.engine = -1
        self.prefilled = 0
        self.generated = 0
        self.first_token = -1.0
        self.finish = -1.0


class LRUBytes:
    """Adapters by name with their size; least recently used first."""

    def __init__(self, capacity: float) -> None:
        self.capacity, self.used = capacity, 0.0
        self.items: OrderedDict[str, float] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def touch(self, name: str) -> None:
        self.items.move_to_end(name)

    def remove(self, name: str) -> None:
        if name in self.items:
            self.used -= self.items.pop(name)

    def add(self, name: str, size: float, pinned: set[str]) -> None:
        """Insert (most recent) and evict unpinned LRU entries to fit."""
        if name in self.items:
            self.touch(name)
            return
        self.items[name] = size
        self.used += size
        for victim in list(self.items):
            if self.used <= self.capacity:
                break
            if victim != name and victim not in pinned:
                self.used -= self.items.pop(victim)


class SimEngine:
    def __init__(self, index: int, profile: Profile, config: EngineConfig) -> None:
        self.index, self.profile, self.config = index, profile, config
        self.model = profile.step
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.host = LRUBytes(config.host_bytes)
        self.gpu = LRUBytes(config.gpu_adapter_bytes)
        self.fetch_ready: dict[str, float] = {}  # adapter -> time its fetch completes
        self.link_free_at = 0.0
        self.kv_reserved = 0
        self.in_use: Counter[str] = Counter()  # adapter -> requests waiting or running here
        self._step: tuple[list[SimRequest], list[tuple[SimRequest, int]]] | None = None
        # load aggregates a router reads (Toppings' EngineView)
        self.running_ranks: Counter[int] = Counter()
        self.queued_ranks: Counter[int] = Counter()
        self.running_rank_sum = 0
        self.queued_rank_sum = 0
        self.queued_prompt_tokens = 0
        self.queued_prompt_lora = 0.0
        # statistics
        self.steps = 0
        self.busy_time = 0.0
        self.fetches = 0
        self.device_loads = 0
        self.adapters_seen: set[str] = set()

    # -- adapters -----------------------------------------------------------
    def has_host(self, adapter: str) -> bool:
        return adapter in self.host

    def fetch(self, adapter: str, rank: int, now: float) -> float:
        """Start (or join) a fetch into host memory; returns when it completes."""
        if adapter in self.host:
            return now
        if adapter in self.fetch_ready:
            return self.fetch_ready[adapter]
        start = max(now, self.link_free_at)
        done = start + self.profile.adapter_bytes(rank) / self.profile.remote_fetch_bytes_per_s
        self.link_free_at = done
        self.fetch_ready[adapter] = done
        self.fetches += 1
        return done

    def fetched(self, adapter: str, rank: int) -> None:
        self.fetch_ready.pop(adapter, None)
        self.host.add(adapter, self.profile.adapter_bytes(rank), set(self.in_use))

    def preload(self, adapter: str, rank: int) -> None:
        """Place an adapter in host memory at no cost (initial placement)."""
        self.host.add(adapter, self.profile.adapter_bytes(rank), set(self.in_use))

    def unload(self, adapter: str) -> None:
        """Drop the adapter from host and device memory (no request uses it)."""
        assert not self.in_use[adapter], "unload only a drained adapter"
        self.host.remove(adapter)
        self.gpu.remove(adapter)

    # -- requests -----------------------------------------------------------
    def enqueue(self, r: SimRequest) -> None:
        r.engine = self.index
        self.waiting.append(r)
        self.in_use[r.req.adapter] += 1
        self.adapters_seen.add(r.req.adapter)
        self.queued_ranks[r.req.rank] += 1
        self.queued_rank_sum += r.req.rank
        self.queued_prompt_tokens += r.req.prompt_len
        self.queued_prompt_lora += r.req.prompt_len * r.req.rank

    def has_work(self) -> bool:
        """Something to compute now (a waiting request whose adapter is here)."""
        return bool(self.running) or any(r.req.adapter in self.host for r in self.waiting)

    # -- steps --------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Start the next step if idle with work; returns when it ends."""
        if self._step is not None or not self.has_work():
            return None
        duration, decode, chunks = self.build_step()
        self._step = (decode, chunks)
        self.steps += 1
        self.busy_time += duration
        return now + duration

    def end_step(self, now: float) -> list[SimRequest]:
        """End the running step at `now`; returns the requests it finished."""
        decode, chunks = self._step
        self._step = None
        return self.finish_step(now, decode, chunks)

    def build_step(self) -> tuple[float, list[SimRequest], list[tuple[SimRequest, int]]]:
        """(duration, decoding requests, (request, prompt tokens) chunks)."""
        budget = self.profile.max_batched_tokens
        decode = [r for r in self.running if r.prefilled == r.req.prompt_len]
        budget -= len(decode)
        chunks: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            left = r.req.prompt_len - r.prefilled
            if left > 0:
                take = min(left, budget)
                chunks.append((r, take))
                budget -= take
        load_s = 0.0
        if budget > 0 and self.waiting:
            skipped: deque[SimRequest] = deque()  # adapter still being fetched
            while (self.waiting and budget > 0
                   and len(self.running) < self.profile.max_num_seqs):
                r = self.waiting[0]
                if r.req.adapter not in self.host:
                    skipped.append(self.waiting.popleft())
                    continue
                need = r.req.prompt_len + r.req.output_len
                if self.kv_reserved + need > self.config.kv_capacity_tokens:
                    break  # first come, first served: no overtaking for memory
                self.waiting.popleft()
                load_s += self._admit(r, need)
                take = min(r.req.prompt_len, budget)
                chunks.append((r, take))
                budget -= take
            skipped.extend(self.waiting)
            self.waiting = skipped
        prefill_tokens = sum(n for _, n in chunks)
        if self.model.kind == "mbgmv":
            lora = sum(n * r.req.rank for r, n in chunks) + sum(r.req.rank for r in decode)
        else:
            ranks = [r.req.rank for r, _ in chunks] + [r.req.rank for r in decode]
            lora = (prefill_tokens + len(decode)) * max(ranks, default=0)
        duration = self.model.time(prefill_tokens, len(decode), lora)
        if not self.config.overlap_loads:
            duration += load_s
        return duration, decode, chunks

    def _admit(self, r: SimRequest, need: int) -> float:
        """Move a waiting request to running; the device-load seconds it costs."""
        self.running.append(r)
        self.kv_reserved += need
        req = r.req
        self.queued_ranks[req.rank] -= 1
        if not self.queued_ranks[req.rank]:
            del self.queued_ranks[req.rank]
        self.queued_rank_sum -= req.rank
        self.queued_prompt_tokens -= req.prompt_len
        self.queued_prompt_lora -= req.prompt_len * req.rank
        self.running_ranks[req.rank] += 1
        self.running_rank_sum += req.rank
        self.host.touch(req.adapter)
        if req.adapter in self.gpu:
            self.gpu.touch(req.adapter)
            return 0.0
        self.device_loads += 1
        size = self.profile.adapter_bytes(req.rank)
        self.gpu.add(req.adapter, size, {x.req.adapter for x in self.running})
        return size / self.profile.host_to_device_bytes_per_s

    def finish_step(self, now: float, decode: list[SimRequest],
                    chunks: list[tuple[SimRequest, int]]) -> list[SimRequest]:
        """Apply a step that ended at `now`; returns the requests it finished."""
        done = []
        for r in decode:
            r.generated += 1
            if r.generated >= r.req.output_len:
                done.append(r)
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled == r.req.prompt_len:
                r.generated = 1
                r.first_token = now
                if r.req.output_len <= 1:
                    done.append(r)
        for r in done:
            r.finish = now
            self.running.remove(r)
            self.kv_reserved -= r.req.prompt_len + r.req.output_len
            self.in_use[r.req.adapter] -= 1
            if not self.in_use[r.req.adapter]:
                del self.in_use[r.req.adapter]
            self.running_ranks[r.req.rank] -= 1
            self.running_rank_sum -= r.req.rank
            if not self.running_ranks[r.req.rank]:
                del self.running_ranks[r.req.rank]
        return done
