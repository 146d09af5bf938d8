"""The API server's catalogue of every adapter it knows, valid or not.

Adapters come from `--lora-modules`, `--loraserve-adapter-dir` and runtime
`/v1/load_lora_adapter` calls. Each is inspected (config and safetensors
header only, on a thread: not the event loop) and checked against the
served model *before* its name becomes
routable: vLLM reads adapters inside the engine step, where a bad one takes
the whole engine down. Its tensors (NaN/Inf, a scaling that overflows the
serving dtype) are not read here with the paged pool: its workers check them
as they read them into the host tier, once, and a failure there is that
adapter's alone (a refused runtime or `--lora-modules` load, or its
requests' error, frontend/serving.py `note_engine_failure`). With
`--loraserve-pool vllm`, whose workers have no such isolation, the catalogue
reads them, on threads of its own (not the event loop's default pool): at a
runtime or `--lora-modules` load, or on the first request for a directory
adapter.
Invalid configured adapters stay in the catalogue with the reason, so
requests naming them get a 4xx that says what is wrong; a refused runtime
load only gets its 4xx.

Invariant: an entry has exactly one of `spec` (servable) and `error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm_loraserve.adapters.peft import (
    AdapterError,
    ModelLoRAInfo,
    PeftSpec,
    check_against_model,
    check_finite_weights,
    inspect_adapter,
)
from vllm_loraserve.adapters.safety import shown_path
from vllm_loraserve.worker.residency import MAX_BUFFERED_EVENTS

# Where an adapter's weights are: only its files (disk), read into host
# memory (host), or where the kernels read them (device: vLLM's slots or the
# pool's pages, in GPU memory on CUDA and in RAM on a CPU machine, so the
# listing gives the device type beside it).
RESIDENCIES = ("disk", "host", "device")
# A worker buffers at most this many load events, so no older id can still
# have events to name.
MAX_RETIRED_IDS = MAX_BUFFERED_EVENTS
# `--loraserve-pool vllm` only: the tensor reads of `check_finite_weights`,
# kept off the event loop's default pool (vLLM's own work runs there).
WEIGHT_CHECK_THREADS = 2


class WeightsUnchecked(RuntimeError):
    """An adapter's tensors could not be read for their check (an I/O error,
    say): nothing is known against it, and the next request checks again."""


@dataclass
class AdapterEntry:
    name: str
    path: str
    source: str  # "lora-modules" | "adapter-dir" | "runtime"
    spec: PeftSpec | None = None
    error: str | None = None
    lora_int_id: int | None = None
    residency: str = "disk"
    pages: int | None = None  # pages held in the paged pool, when resident there
    # tensors read for NaN/Inf (check_finite_weights; `--loraserve-pool vllm` only)
    weights_checked: bool = False

    def to_json(self, roots: Collection[str]) -> dict[str, Any]:
        """The entry for clients: paths relative to the adapter `roots`
        (adapters/safety.py `shown_path`), also inside the error."""
        path = shown_path(self.path, roots)
        out: dict[str, Any] = {"name": self.name, "path": path, "source": self.source}
        if self.spec is None:
            return {**out, "status": "invalid", "error": self.error.replace(self.path, path)}
        s = self.spec
        return {
            **out,
            "status": "ready",
            "rank": s.rank,
            "alpha": s.alpha,
            "use_rslora": s.use_rslora,
            "scaling": s.scaling,
            "target_modules": s.target_modules,
            "size_bytes": s.size_bytes,
            "base_model": s.base_model,
            "residency": self.residency,
            **({"pages": self.pages} if self.pages is not None else {}),
        }


class KeyedLocks:
    """One asyncio lock per key, kept only while a task holds or waits for it
    (so nothing grows with the names clients try)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]


class AdapterCatalog:
    """Invariant: `entries` holds what the operator configured (valid or not)
    and what runtime loads made servable; a refused runtime load is answered
    with its reason and leaves no entry (so nothing grows with bad requests)."""

    def __init__(self, fetch_model_info: Callable[[], Awaitable[ModelLoRAInfo]],
                 max_weight: float | None) -> None:
        """`max_weight`: the largest finite value of the serving dtype, which
        B * scaling must not exceed (`check_finite_weights`), for a catalogue
        that reads the tensors itself; None when the workers check them as
        they read them (the paged pool): then this catalogue never reads a
        tensor."""
        self._fetch_model_info = fetch_model_info
        self._max_weight = max_weight
        self._checks = None if max_weight is None else ThreadPoolExecutor(
            WEIGHT_CHECK_THREADS, thread_name_prefix="loraserve-check")
        self._model_info: ModelLoRAInfo | None = None
        self.entries: dict[str, AdapterEntry] = {}
        self._names_by_id: dict[int, str] = {}
        # Ids of unloaded adapters: their load events may still be in a
        # worker's buffer, and their metrics keep the adapter's name.
        self._retired: OrderedDict[int, str] = OrderedDict()
        self._weight_checks: dict[str, asyncio.Future[None]] = {}
        # Resident on the worker but bound to no entry (last `update_residency`):
        # an unloaded adapter's copy, while a request it admitted still runs.
        self.orphans: list[dict[str, Any]] = []
        # Loads, reloads and unloads of one version line (`alias_of`) run one
        # at a time, as SGLang's LoRARegistry serialises them per name: each
        # reads vLLM's `lora_requests`, awaits the engine, then writes it and
        # this catalogue, and vLLM's own per-name lock covers only its part
        # (an unload could read the entry before a load wrote it, then fail
        # or leave the worker's copy behind).
        self.line_locks = KeyedLocks()

    async def model_info(self) -> ModelLoRAInfo:
        if self._model_info is None:
            self._model_info = await self._fetch_model_info()
        return self._model_info

    def _check_finite(self, spec: PeftSpec) -> asyncio.Future[None]:
        return asyncio.get_running_loop().run_in_executor(
            self._checks, check_finite_weights, spec, self._max_weight)

    async def inspect(self, name: str, path: str, source: str,
                      read_weights: bool = False) -> AdapterEntry:
        """Inspect and check an adapter against the model; nothing is recorded.
        `read_weights`: also read every tensor for NaN/Inf and the scaling's
        overflow (on the catalogue's threads), if this catalogue checks
        tensors at all (`max_weight`)."""
        entry = AdapterEntry(name=name, path=os.path.abspath(path), source=source)
        try:
            # Off the event loop: a header may be 100 MB, the files on a slow disk.
            spec = await asyncio.to_thread(inspect_adapter, path)
            check_against_model(spec, await self.model_info())
            if read_weights and self._checks is not None:
                await self._check_finite(spec)
                entry.weights_checked = True
            entry.spec = spec
        except AdapterError as e:
            entry.error = str(e)
        return entry

    def record(self, entry: AdapterEntry) -> None:
        """Make `entry` the catalogue's version of its name, unless it is an
        invalid replacement of a servable one (then the served one stays)."""
        previous = self.entries.get(entry.name)
        if entry.error is not None and previous is not None and previous.spec is not None:
            return
        self.entries[entry.name] = entry
        self._weight_checks.pop(entry.name, None)
        if previous is not None and previous.lora_int_id is not None:
            self.bind(entry.name, previous.lora_int_id)

    async def admit(self, name: str, path: str, source: str,
                    read_weights: bool = False) -> AdapterEntry:
        """`inspect`, then `record` (invalid entries too, with the reason)."""
        entry = await self.inspect(name, path, source, read_weights)
        self.record(entry)
        return entry

    async def check_weights(self, name: str) -> str | None:
        """Why `name` cannot be served, reading its tensors on first use if
        that was not done at admission (adapter directories, when this
        catalogue checks tensors); None if it can."""
        entry = self.entries.get(name)
        if entry is None or entry.spec is None or entry.weights_checked or \
                self._checks is None:
            return None if entry is None else entry.error
        check = self._weight_checks.get(name)
        if check is None:  # one read per adapter version, shared by concurrent requests
            check = self._check_finite(entry.spec)
            self._weight_checks[name] = check
        try:
            await asyncio.shield(check)
            failed = None
        except AdapterError as e:
            failed = str(e)
        except Exception as e:  # not the adapter's fault: a later request checks again
            if self._weight_checks.get(name) is check:
                del self._weight_checks[name]
            raise WeightsUnchecked(f"{type(e).__name__}: {e}") from e
        if self.entries.get(name) is entry:
            if failed is not None:
                entry.spec, entry.error = None, failed
            entry.weights_checked = True
            self._weight_checks.pop(name, None)
        return entry.error

    def bind(self, name: str, lora_int_id: int) -> None:
        """Record the engine-side id vLLM's frontend gave this adapter."""
        self.entries[name].lora_int_id = lora_int_id
        self._names_by_id[lora_int_id] = name

    def reject(self, name: str, reason: str) -> None:
        """Mark an admitted adapter invalid (the engine could not serve it:
        its files could not be read after the checks)."""
        entry = self.entries[name]
        entry.spec, entry.error = None, reason

    def invalid_reason(self, name: str) -> str | None:
        entry = self.entries.get(name)
        return entry.error if entry is not None else None

    def forget(self, name: str) -> AdapterEntry | None:
        entry = self.entries.pop(name, None)
        self._weight_checks.pop(name, None)
        if entry is not None and entry.lora_int_id is not None:
            self._names_by_id.pop(entry.lora_int_id, None)
            self._retired[entry.lora_int_id] = name
            while len(self._retired) > MAX_RETIRED_IDS:
                self._retired.popitem(last=False)
        return entry

    def update_residency(self, device_ids: Iterable[int], host_ids: Iterable[int],
                         pages: dict[int, int] | None = None) -> None:
        """Tiers from a worker's `ResidencyReport`; `pages` (paged pool only)
        per device id."""
        device, host, pages = set(device_ids), set(host_ids), pages or {}
        for entry in self.entries.values():
            i = entry.lora_int_id
            entry.residency = "device" if i in device else "host" if i in host else "disk"
            entry.pages = pages.get(i) if i in device else None
        bound = {e.lora_int_id for e in self.entries.values()}
        self.orphans = [{"lora_int_id": i, "name": self.name_of(i),
                         "residency": "device" if i in device else "host",
                         **({"pages": pages[i]} if i in pages else {})}
                        for i in sorted((device | host) - bound)]

    def name_of(self, lora_int_id: int) -> str | None:
        """The adapter name of an engine-side id, also after its unload."""
        return self._names_by_id.get(lora_int_id) or self._retired.get(lora_int_id)

    def counts(self) -> dict[str, int]:
        """Adapters per residency tier, plus invalid ones."""
        out = dict.fromkeys((*RESIDENCIES, "invalid"), 0)
        for entry in self.entries.values():
            out["invalid" if entry.spec is None else entry.residency] += 1
        return out

