"""vLLM's worker LoRA manager, replaced by the paged pool.

`PagedWorkerLoRAManager` takes the place of vLLM's `LRUCacheWorkerLoRAManager`
in every model runner (worker/hooks.py) and honours the narrow interface the
runners use (set_active_adapters, add/remove/list adapters, the dummy-adapter
warm-up calls). Differences from vLLM:

- vLLM's LoRA layer classes still wrap the model (they know TP slicing and
  packed layers), but hold no weights: each gets a `PagedLinearLoRA` as its
  punica wrapper, which computes from KV pages (worker/pool.py).
- Residency is decided by the scheduler (scheduler/pages.py); `apply_step`
  carries out its `PoolStep` before each forward pass.
- Loaded adapters are kept, as their weights files hold them, in the host
  tier (worker/host_tier.py: one arena allocated, and pinned on a GPU, here
  at start-up; nothing is pinned while serving), filled by `read_threads`
  background readers from the scheduler's prefetch hints (and by a runtime
  `add_lora`; with `--loraserve-read-in processes`, each read runs in
  reader processes that map the arena: worker/file_readers.py). A hint is
  read only when the tier has room beside the entries waiting requests
  still need (`PoolStep.keep`), so read-ahead never evicts
  what it read for the queue before those requests are admitted. Each step's
  `PoolReport` tells the scheduler which adapters are in that tier, so it
  admits a request only once its adapter is; a step reads from disk itself
  only if the tier dropped an adapter after reporting it. A runtime remove
  drops the adapter's copy; one read back for requests admitted before the
  remove goes once no page or waiting request needs it.
- An adapter whose load fails at any stage (weights that hold NaN/Inf or
  overflow the serving dtype, found by the read itself; its files changed or
  removed on disk after its checks, a module this model does not have, an
  error while packing or writing its pages) is marked failed with the
  reason: its tokens run without LoRA until the scheduler has heard (that
  step, and one scheduled before the report), and the scheduler fails its
  requests; the engine goes on. A transient error (host_tier.py
  `is_transient`: an I/O error, host or device memory that ran out) fails
  only the requests of that moment: the next request loads it again.
- Embedding and lm_head adapters are not wrapped, so the API server's checks
  refuse adapters that target them (HTTP 400, naming the module).
- `--loraserve-cold-start` (worker/cold_start.py): `block` loads a step's
  adapters whole before its forward pass; `pipelined` and `cpu-assist` hand
  the loads that are not ahead to a `ColdStart`, which writes them layer
  group by layer group beside the forward pass; `auto` (the default) is
  pipelined on CUDA and block on the CPU (`resolve_mode`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
from vllm.lora.model_manager import LoRAModelManager, create_lora_manager
from vllm.lora.worker_manager import WorkerLoRAManager
from vllm.model_executor.models.utils import extract_layer_index

from vllm_loraserve._patching import overlay
from vllm_loraserve.adapters.peft import read_weights, short_name
from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.tile_table import TileTable
from vllm_loraserve.paging.layout import pack_layers, warm_up_pack
from vllm_loraserve.paging.model import max_file_bytes, model_layout, module_slice_names
from vllm_loraserve.paging.step import TRANSIENT_NOTE, PageLoad, PoolReport, PoolStep, Prefetch
from vllm_loraserve.worker.arena import PinnedArena
from vllm_loraserve.worker.assist import CpuAssist
from vllm_loraserve.worker.cold_start import ColdStart, layer_groups, resolve_mode
from vllm_loraserve.worker.cpu_lora.pool import CpuPoolConfig, CpuWorkerPool
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks
from vllm_loraserve.worker.file_readers import ReaderProcesses
from vllm_loraserve.worker.host_tier import (
    Alloc,
    HostAdapter,
    HostTier,
    StepOverflow,
    is_transient,
)
from vllm_loraserve.worker.pack_tables import TablePacker, file_table
from vllm_loraserve.worker.paged_layer import PagedLinearLoRA
from vllm_loraserve.worker.pool import DevicePool
from vllm_loraserve.worker.read_gate import read_gate_for
from vllm_loraserve.worker.report import LoadEvent, PoolCounters, ResidencyReport
from vllm_loraserve.worker.residency import MAX_BUFFERED_EVENTS, lora_modules
from vllm_loraserve.worker.step_trace import StepTrace

logger = logging.getLogger(f"vllm.{__name__}")


class PagedLoRAModelManager(LoRAModelManager):
    """vLLM's model manager for module wrapping only; it never activates
    adapters (the pool does)."""

    @property
    def lora_slots(self) -> int:
        return 1

    def _match_target_modules(self, module_name: str) -> bool:
        if module_name.rsplit(".", 1)[-1] in getattr(self.model, "embedding_modules", {}):
            return False
        return super()._match_target_modules(module_name)

    def _create_lora_modules(self) -> None:
        # With max_lora_rank 1, vLLM's layers allocate 1-row stacks (they must
        # exist, but the pool never reads them).
        real, self.lora_config = self.lora_config, overlay(self.lora_config, max_lora_rank=1)
        try:
            super()._create_lora_modules()
        finally:
            self.lora_config = real


@dataclass(frozen=True)
class _StreamFence:
    """Done once the copies issued so far on these streams are (the host
    tier reuses an evicted entry's memory only then)."""

    device: torch.device
    events: tuple[torch.cuda.Event, ...]

    @classmethod
    def record(cls, device: torch.device, streams: Sequence[torch.cuda.Stream]) -> _StreamFence:
        events = tuple(torch.cuda.Event() for _ in streams)
        for event, stream in zip(events, streams, strict=True):
            event.record(stream)
        return cls(device, events)

    def query(self) -> bool:
        with torch.cuda.device(self.device):  # readers call it too
            return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def _on_device(choice: str, device: torch.device | str) -> str:
    """A kernel choice (--loraserve-kernel, --loraserve-pack) with 'auto'
    resolved: triton on CUDA, torch elsewhere."""
    if choice != "auto":
        return choice
    return "triton" if torch.device(device).type == "cuda" else "torch"


class PagedWorkerLoRAManager(WorkerLoRAManager):
    _manager_cls = PagedLoRAModelManager

    def __init__(self, vllm_config: Any, device: torch.device,
                 embedding_modules: dict[str, str], cfg: LoraServeConfig) -> None:
        super().__init__(vllm_config, device, embedding_modules)
        self.cfg = cfg
        cuda = torch.device(self.device).type == "cuda"
        self.cold_start = resolve_mode(cfg.cold_start, torch.device(self.device))
        # Loads for waiting requests (PageLoad.ahead) run on this stream on a GPU.
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._tables: TablePacker | None = None  # --loraserve-pack triton, made at bind
        # The host tier's memory, pinned here (before the KV cache and the
        # server's start) and never later; its chunks hold the largest
        # adapter this engine serves.
        largest = max_file_bytes(vllm_config.model_config.hf_text_config,
                                 self.lora_config.max_lora_rank)
        # The reader processes write, and cpu-assist's workers read, the
        # weights where the tier keeps them: its chunks are then
        # shared-memory segments they map.
        readers_map = cfg.read_in == "processes"
        self._shared = (SharedChunks(pinned=cuda) if readers_map or self.cold_start ==
                        "cpu-assist" and cfg.cpu_assist_workers >= 0 else None)
        arena = PinnedArena.for_budget(cfg.host_budget(), largest, pinned=cuda,
                                       make_chunk=self._shared)
        self._files: ReaderProcesses | None = None
        if readers_map:
            self._files = ReaderProcesses(self._shared.segments, cfg.read_threads)
            logger.warning("vllm-loraserve: --loraserve-read-in processes is experimental: "
                           "one of its three runs on an H200 stalled, unexplained "
                           "(docs/benchmarks/e2e.md, session 30)")
        # --loraserve-read-pause: reads park while the engine thread launches a
        # forward pass (worker/hooks.py closes the gate), while --loraserve-read-
        # pause-reads of them are under way.
        self.read_gate = read_gate_for(cfg.read_pause, cfg.read_pause_reads)
        # Each read splits its file's read and check over these (one reader
        # thread alone reads and checks at ~1.4-1.8 GB/s).
        self._read_parts = None if readers_map else ThreadPoolExecutor(
            cfg.read_threads, thread_name_prefix="loraserve-read-part",
            initializer=torch.set_num_threads, initargs=(1,))
        self.host: HostTier[HostAdapter] = HostTier(
            arena, self._read_file, cfg.read_threads, fence=self._fence,
            on_read=lambda lora_id, seconds: self._record(lora_id, "host", seconds))
        self._lock = threading.Lock()  # events and waits, shared with the readers
        self.step_trace = StepTrace.from_env()  # None unless LORASERVE_STEP_TRACE is set
        # Page loads whose adapter was already in the host tier (hits) or had
        # to be read, or waited for, inside the step (misses).
        self.prefetch_hits = self.prefetch_misses = 0
        self._waits: deque[float] = deque(maxlen=MAX_BUFFERED_EVENTS)
        self.pool: DevicePool  # made by create_lora_manager
        self._dummy_ids: set[int] = set()
        # Adapters whose last load failed (under _lock: the report's thread
        # adds too): steps scheduled before the scheduler heard still run
        # their tokens, without LoRA. A transient failure is reported once,
        # so the host tier's `failed_ids` no longer holds them then.
        self._failed_loads: set[int] = set()
        self.page_loads = self.page_evictions = self.page_loads_ahead = 0
        # Loads a step issued before its other reads, its adapters outgrowing the host tier.
        self.host_overflow_loads = 0
        # Host seconds of page loads: packing on the device (the copy of the
        # file's bytes included), then writing the pages and the slot table.
        self.load_pack_s = self.load_write_s = 0.0
        self._events: deque[LoadEvent] = deque(maxlen=MAX_BUFFERED_EVENTS)
        self.dropped_events = 0
        self.cold: ColdStart | None = None  # made with the pool, unless cold_start is block
        self._warming: set[int] = set()  # adapters whose read `warm` started, under way

    # -- model wrapping -----------------------------------------------------
    def create_lora_manager(self, model: torch.nn.Module, vllm_config: Any) -> Any:
        manager = create_lora_manager(
            model, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, vocab_size=self.vocab_size,
            lora_config=self.lora_config, vllm_config=vllm_config, device=self.device,
            lora_manager_cls=self._manager_cls)
        self._adapter_manager = manager
        # What an adapter may name (PEFT paths): anything else fails its read.
        self._module_paths = frozenset(lora_modules(manager)["modules"])
        text_config = vllm_config.model_config.hf_text_config
        self.num_layers = text_config.num_hidden_layers
        # The page size is only known once the KV cache exists; the slices are
        # not, and the wrapped layers must match them (checked here).
        layout = model_layout(text_config, 256)
        backend = _on_device(self.cfg.kernel, self.device)
        layers = []
        for name, module in manager.modules.items():
            if not isinstance(module, BaseLinearLayerWithLoRA):
                raise ValueError(f"the loraserve pool computes linear LoRA layers only; "
                                 f"{name} is a {type(module).__name__} "
                                 "(use --loraserve-pool vllm)")
            ms = ModuleSlices.of(layout, module_slice_names(name.rsplit(".", 1)[-1]))
            if (ms.in_features, ms.out_features) != (module.input_size,
                                                     tuple(module.output_slices)):
                raise ValueError(
                    f"{name}: the model's LoRA layer is {module.input_size} -> "
                    f"{tuple(module.output_slices)}, the pool's layout says {ms.in_features} "
                    f"-> {ms.out_features} (use --loraserve-pool vllm)")
            layers.append((module, extract_layer_index(name), ms))
        self._module_kinds = {ms for _, _, ms in layers}
        mode = self.cold_start
        groups = () if mode == "block" else layer_groups(self.num_layers,
                                                         self.cfg.cold_start_group_layers)
        self.pool = DevicePool(layout.slices, self.num_layers, self.lora_config.max_lora_rank,
                               self.max_num_batched_tokens, self.cfg.max_slots,
                               max(ms.count for _, _, ms in layers), backend,
                               torch.device(self.device), layer_groups=groups,
                               tiles=self._tile_table())
        if mode != "block":
            self.cold = ColdStart(mode, self.pool, torch.device(self.device), self._side,
                                  self._device_streams, self._fail_load, self._cold_loaded,
                                  self._assist(layout) if mode == "cpu-assist" else None)
            self.pool.gate = self.cold
            logger.info("vllm-loraserve cold start: %s, %d layer groups of %d layers", mode,
                        len(groups), self.cfg.cold_start_group_layers)
        # Before vLLM compiles the model: its trace must see these wrappers.
        for module, layer, ms in layers:
            module.set_mapping(PagedLinearLoRA(self.pool, layer, ms))
        return manager.model

    def _assist(self, layout: Any) -> CpuAssist | CpuWorkerPool:
        """cpu-assist's deltas: the CPU worker processes over the host tier's
        shared chunks, or the engine's own threads (--loraserve-cpu-assist-workers -1)."""
        if self.cfg.cpu_assist_workers < 0:
            logger.info("vllm-loraserve cpu-assist: deltas on the engine's own threads")
            return CpuAssist()
        # The spare cores are split between the GPUs this process sees, by
        # device index (servers that each see one GPU need their own affinity).
        device = torch.device(self.device)
        gpus = torch.cuda.device_count() if device.type == "cuda" else 1
        return CpuWorkerPool(
            CpuPoolConfig(workers=self.cfg.cpu_assist_workers, read_threads=self.cfg.read_threads,
                          gpu_workers=gpus, local_rank=(device.index or 0) % gpus,
                          max_in=max(s.in_features for s in layout.slices),
                          max_out=max(s.out_features for s in layout.slices),
                          max_rank=self.lora_config.max_lora_rank),
            weights=self._shared.segments, pin=device.type == "cuda")

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Attach the pool to the KV cache (once, after vLLM made it)."""
        self.pool.bind(kv_caches)
        t0 = time.perf_counter()
        variants = self.pool.warm_up(self._module_kinds)
        if self.pool.device.type == "cuda":
            # CUDA loads a kernel at its first launch, and that load waits for the
            # whole device: the first load packed on the side stream (ahead, or a
            # cold start's group) would wait for the forward pass it should run beside.
            warm_up_pack(self.pool.layout, self.lora_config.lora_dtype, self.pool.device)
        if _on_device(self.cfg.pack, self.pool.device) == "triton":
            self._tables = TablePacker(self.pool.layout, self.num_layers,
                                       self.lora_config.lora_dtype, self.pool.device)
            self._tables.warm_up()
        if self.cold is not None:
            self.cold.warm_up(self._module_kinds)
        self._say_table_use()
        logger.info("vllm-loraserve pool bound: %d layers, %d pages of %d elements, %s kernels "
                    "(%d variants warmed up in %.1f s)", self.num_layers, kv_caches[0].shape[0],
                    self.pool.layout.page_size, type(self.pool.backend).__name__, variants,
                    time.perf_counter() - t0)

    # -- host tier ------------------------------------------------------------
    def _record(self, lora_id: int, tier: str, seconds: float) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped_events += 1
            self._events.append(LoadEvent(lora_id, tier, seconds))

    def _fence(self) -> _StreamFence | None:
        """After the copies issued so far (none pending on a CPU device)."""
        if self._side is None:
            return None
        return _StreamFence.record(torch.device(self.device),
                                   (torch.cuda.current_stream(), self._side))

    def _entry_bytes(self, pages: int) -> int:
        """An estimate of a read's host bytes, for adapters not read yet: their
        page-layout size (the file holds about as much in the pool's dtype)."""
        dtype = self.lora_config.lora_dtype
        return self.num_layers * pages * self.pool.layout.page_size * dtype.itemsize

    def prefetch(self, hint: Prefetch) -> None:
        """Start reading an adapter into the host tier in the background, if
        the tier has room for it beside the entries waiting requests need
        (else a later step's hint starts it)."""
        self.host.prefetch(hint.lora_request, self._entry_bytes(hint.pages))

    def warm(self, lora_request: Any, nbytes: int) -> tuple[str, str | None]:
        """Read an adapter into the host tier before any request needs it
        (the API server's prefetch route): in the background, as a hint is,
        if the tier has room for it beside the entries it keeps. Where it
        stands then: HostTier.state's answer, or ("no-room", None) where no
        read is under way (none started, or one gave up for want of room).
        A transient failure is answered once and forgotten: the next ask
        reads again, and no later request fails for it."""
        lora_id = lora_request.lora_int_id
        reason = self.host.take_transient_failure(lora_id)
        if reason is not None:
            self._warming.discard(lora_id)
            return "failed", reason
        if self.host.state(lora_id)[0] == "absent" and lora_id in self._warming:
            # The read the last ask started ended with no entry: it gave up
            # for want of a whole extent (free bytes in pieces), or what it
            # read was evicted since. No room; the ask after this reads again.
            self._warming.discard(lora_id)
            return "no-room", None
        if self.host.prefetch(lora_request, nbytes):
            self._warming.add(lora_id)
        state = self.host.state(lora_id)
        if state[0] != "reading":
            self._warming.discard(lora_id)
        return ("no-room", None) if state[0] == "absent" else state

    def _read_file(self, lora_request: Any, alloc: Alloc) -> HostAdapter:
        """Disk -> host tier (its reader, on a reader thread or in a step):
        the weights file's data in one buffer of the tier's arena (one copy
        per adapter; vLLM's loader pins every A and B tensor apart), its
        values checked there (NaN/Inf, scaling * max|B| within the serving
        dtype: the API server reads no tensors, so this is the adapter's only
        read), then against the pool's layout. No other tensor math here:
        readers scale with threads, and the packing into page layout runs on
        the device at load (`_device_streams`)."""
        gate = self.read_gate
        # A read counts for the gate up to its last checkpoint: a lone one passes.
        with gate.reading() if gate else contextlib.nullcontext():
            spec, raw = read_weights(lora_request.lora_path, alloc,
                                     torch.finfo(self.lora_config.lora_dtype).max,
                                     parts=self._read_parts, files=self._files,
                                     pause=gate.pause if gate else None)
            if gate:
                gate.pause()  # the checks and the pack table below are Python work too
        layout = self.pool.layout
        slices = {s.name: s for s in layout.slices}
        where = {}
        for name, (a, b) in raw.modules.items():
            short = short_name(name)
            s = slices.get(short)
            if name not in self._module_paths:
                raise ValueError(f"adapter {lora_request.lora_name} targets {name}, which "
                                 "this model does not have")
            if s is None:
                raise ValueError(f"adapter {lora_request.lora_name} targets {name}, which "
                                 "the loraserve pool does not serve")
            if (a.shape[1], b.shape[0]) != (s.in_features, s.out_features):
                raise ValueError(f"{name} is {a.shape[1]} -> {b.shape[0]}, the model's "
                                 f"{short} is {s.in_features} -> {s.out_features}")
            where[name] = (extract_layer_index(name), short)
        placement = layout.place(spec.rank, spec.target_modules)
        table = None if self._tables is None else file_table(  # one launch packs it
            layout, self.num_layers, placement, raw, where)
        return HostAdapter(lora_request.lora_name, placement, spec.scaling, raw, where, table)

    def _device_streams(self, entry: HostAdapter, layers: range | None = None,
                        data: torch.Tensor | None = None) -> torch.Tensor:
        """The entry's page streams ([layers, pages * page_size]) of
        `layers` (default: all) on the device: one host-to-device copy of
        the file's bytes (unless `data` holds them there already: a layer
        group's load copies its own), then A copied and B transposed and
        scaled there for those layers at once, on the current stream: in one
        launch from the entry's pack table (--loraserve-pack triton), else
        with torch (pack_layers)."""
        if data is None:
            data = entry.weights.data.to(self.device, non_blocking=True)
        layers = range(self.num_layers) if layers is None else layers
        if self._tables is not None and entry.pack_table is not None:
            streams = self._tables.pack(entry, data, layers)
            if streams is not None:
                return streams
        return pack_layers(self.pool.layout, entry.placement, entry.layer_weights(layers, data),
                           entry.scaling, self.lora_config.lora_dtype)

    # -- the scheduler's page decisions ---------------------------------------
    def apply_step(self, step: PoolStep | None, idle: bool = False) -> None:
        """Carry out the scheduler's page decisions before the forward pass.
        `idle`: the step runs no tokens (every waiting request's adapter is
        still being read); wait briefly for a read instead of spinning."""
        if self.cold is not None:  # the last step's group loads are in place
            self.cold.begin_step()
        if self._side is not None:  # the last steps' loads ahead are in place first
            torch.cuda.current_stream().wait_stream(self._side)
        self.host.set_keep(step.keep if step else ())
        try:
            if step:
                self._apply(step)
        finally:
            if self.cold is None:
                self.host.end_step()  # this step's copies from the tier are all issued
        if idle:
            self.host.wait_for_a_read(timeout=0.005)

    def end_forward(self) -> None:
        """The step's forward pass is queued (worker/hooks.py, before the
        step's report). With layer-group loads, the forward pass read the host
        tier (CPU deltas, the host lane's copies): the tier's epoch closes
        only now, and the host lane writes what no layer waited for, so a
        load that fails there is in this step's report."""
        if self.cold is not None:
            self.cold.end_forward()
            self.host.end_step()

    def trace_counts(self) -> tuple[int, int, int, int]:
        """Running totals for the step trace (worker/step_trace.py): page loads,
        evictions, and the adapters and adapter bytes of all steps' tokens."""
        return (self.page_loads, self.page_evictions, self.pool.adapter_step_adapters,
                self.pool.adapter_step_bytes)

    def _tile_table(self) -> TileTable | None:
        """--loraserve-tiles, said in the log, with where it was tuned."""
        if not self.cfg.tiles:
            return None
        import triton  # the table tunes its kernels: there where a table is given

        table = TileTable.load(self.cfg.tiles)
        here = (torch.cuda.get_device_name(self.device)
                if torch.device(self.device).type == "cuda" else "cpu", triton.__version__)
        logger.info("vllm-loraserve tiles: %d entries from %s (tuned on %s, Triton %s)",
                    len(table.entries), self.cfg.tiles, table.device, table.triton)
        if (table.device, table.triton) != here:
            logger.warning("vllm-loraserve: the tile table %s was tuned on %s with Triton %s, "
                           "and this is %s with Triton %s: its tiles may not be the best here",
                           self.cfg.tiles, table.device, table.triton, *here)
        return table

    def _say_table_use(self) -> None:
        """After the warm-up, which launched every variant serving can: how many
        of --loraserve-tiles' entries this model's launches take. None is a
        table for other shapes, whose tiles would never run: a warning."""
        table = getattr(self.pool.backend, "table", None)  # the triton kernels' only
        if table is None:
            return
        used = self.pool.backend.table_keys_used
        if not used:
            logger.warning("vllm-loraserve: no entry of the tile table %s fits this model's "
                           "launches (tuned for other shapes?): the built-in rules choose every "
                           "tile", self.cfg.tiles)
        else:
            logger.info("vllm-loraserve tiles: %d of the table's %d entries fit this model's "
                        "launches", len(used), len(table.entries))

    @property
    def force_eager(self) -> bool:
        """The step just applied must run without CUDA graphs (worker/hooks.py)."""
        return self.cold is not None and self.cold.force_eager

    def _apply(self, step: PoolStep) -> None:
        if self.pool.layout is None:
            raise RuntimeError("adapter pages scheduled before the pool was bound to the KV cache")
        for hint in step.prefetch:
            self.prefetch(hint)
        with self._lock:
            self._waits.extend(step.waits)
        for slot in step.evicted:
            self.pool.evict(slot)
        self.page_evictions += len(step.evicted)
        self.page_loads += len(step.loads)
        ready: list[tuple[PageLoad, HostAdapter]] = []
        for load in step.loads:
            lr = load.lora_request
            hit = False
            with self._lock:
                self._failed_loads.discard(lr.lora_int_id)  # loaded anew (or failed anew)
            try:
                # From the tier, a read under way, or disk now (`load_inplace`
                # stays set on every later request of a reloaded adapter; only
                # `add_adapter` acts on it).
                try:
                    entry, hit = self.host.get(lr)
                except StepOverflow:
                    # The step's adapters outgrow the host tier: load those
                    # taken so far now, whole (cold modes too), so that once
                    # their copies are issued their memory takes the next reads.
                    self.host_overflow_loads += len(ready)
                    self._load_whole(ready)
                    ready = []
                    self.host.end_step()
                    entry, hit = self.host.get(lr)
                if (entry.placement.rank, entry.placement.num_pages) != (load.rank,
                                                                          len(load.page_ids)):
                    raise ValueError(
                        f"the files changed since the scheduler checked them: rank "
                        f"{entry.placement.rank} in {entry.placement.num_pages} pages, "
                        f"planned rank {load.rank} in {len(load.page_ids)}")
            except Exception as e:  # a failed read recorded it already
                self._fail_load(load, f"{type(e).__name__}: {e}", e)
                continue
            finally:
                self.prefetch_hits += hit
                self.prefetch_misses += not hit
            ready.append((load, entry))
        if self.cold is not None:
            # Layer groups first: on a GPU they queue on the side stream ahead
            # of the loads ahead, which no layer of this step waits for.
            cold = [(load, entry) for load, entry in ready if not load.ahead]
            if cold:
                self.cold.load(cold)
            ready = [(load, entry) for load, entry in ready if load.ahead]
        self._load_whole(ready)
        # Copies read back for requests admitted before their adapter's remove.
        self.host.drop_removed(self.pool.slot_of.keys())

    def _load_whole(self, ready: list[tuple[PageLoad, HostAdapter]]) -> None:
        """Load each adapter's pages in all layers: a load ahead on the side
        stream (on a GPU), the others on the current stream."""
        for load, entry in ready:
            lr = load.lora_request
            t0 = time.perf_counter()
            try:
                if load.ahead and self._side is not None:
                    # No request of this step uses it: copy beside the forward
                    # pass, after whatever read its pages before (as KV or as
                    # another adapter); the next step's forward waits for it.
                    self._side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self._side):
                        self._load(load, entry)
                else:
                    self._load(load, entry)
            except Exception as e:
                # Packing or writing one adapter's pages failed: its own
                # requests fail (the scheduler reads `failed`), the step goes on.
                self._fail_load(load, f"its pages could not be written: "
                                      f"{type(e).__name__}: {e}", e)
                continue
            self.page_loads_ahead += load.ahead
            self._record(lr.lora_int_id, "gpu", time.perf_counter() - t0)

    def _fail_load(self, load: PageLoad, reason: str, error: BaseException | None = None
                   ) -> None:
        """One adapter's load failed (with `error`, if one was raised): the
        scheduler fails its requests (from `failed`), its slot is cleared
        (its tokens run without LoRA this step)."""
        self._report_failure(load, reason, error)
        self.pool.evict(load.slot)

    def _report_failure(self, load: PageLoad, reason: str,
                        error: BaseException | None = None) -> None:
        """The report's part of `_fail_load` (thread-safe: the report may be
        built on vLLM's output thread)."""
        lr = load.lora_request
        transient = is_transient(error)
        with self._lock:
            self._failed_loads.add(lr.lora_int_id)
        if self.host.fail(lr.lora_int_id, reason, transient):
            logger.error("vllm-loraserve: adapter %s (id %d) cannot be loaded: %s%s",
                         lr.lora_name, lr.lora_int_id, reason,
                         TRANSIENT_NOTE if transient else "")

    def _cold_loaded(self, load: PageLoad, seconds: float) -> None:
        """A load by layer groups wrote its last group (`seconds`: host time
        spent on its groups)."""
        self._record(load.lora_request.lora_int_id, "gpu", seconds)

    def _load(self, load: PageLoad, entry: HostAdapter) -> None:
        t0 = time.perf_counter()
        streams = self._device_streams(entry)
        t1 = time.perf_counter()
        self.pool.load(load.slot, load.lora_request.lora_int_id, entry.placement,
                       load.page_ids, streams)
        self.load_pack_s += t1 - t0
        self.load_write_s += time.perf_counter() - t1

    def report(self) -> PoolReport:
        """The step's report (worker/hooks.py: its output is on the host by now)."""
        if self.cold is not None:  # sync-free CPU deltas that failed fail their adapters
            for load, reason in self.cold.collect():
                self._report_failure(load, reason)
        return self.host.report()

    # -- the model runner's interface -------------------------------------------
    def set_active_adapters(self, requests: set[Any], mapping: Any | None) -> None:
        if mapping is None:
            return
        with self._lock:
            failed = (self.host.failed_ids() | self._failed_loads) - self.pool.slot_of.keys()
        self.pool.set_tokens(np.asarray(mapping.index_mapping), self._dummy_ids | failed)

    def add_dummy_lora(self, lora_request: Any, rank: int) -> bool:
        # Warm-up adapters are never written: their tokens run without LoRA.
        self._dummy_ids.add(lora_request.lora_int_id)
        return True

    def get_dummy_lora_warmup_rank(self, default_rank: int) -> int:
        return default_rank

    def remove_all_adapters(self) -> None:
        # vLLM calls this after warm-up; resident adapters belong to the scheduler.
        self._dummy_ids.clear()

    def add_adapter(self, adapter_request: Any) -> bool:
        """Runtime add_lora (first load or in-place reload): read the files
        into the host tier now. A failure is this load's error only; reads of
        an earlier version still under way commit nothing."""
        self.host.add(adapter_request)
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        return self.host.remove(adapter_id)

    def pin_adapter(self, adapter_id: int) -> bool:
        raise ValueError("pinning adapters is not supported by the loraserve pool yet "
                         "(use --loraserve-pool vllm)")

    def list_adapters(self) -> set[int]:
        return set(self.pool.slot_of) | set(self.host.ids())

    def supports_tower_connector_lora(self) -> bool:
        return False

    # -- residency report (worker/extension.py) -----------------------------------
    def snapshot(self, drain_events: bool = True) -> ResidencyReport:
        gpu = sorted(self.pool.slot_of)
        with self._lock:
            events = tuple(self._events)
            if drain_events:
                self._events.clear()
            waits = tuple(self._waits)
            if drain_events:
                self._waits.clear()
            host_ids, host_bytes = self.host.ids(), self.host.bytes_used
        pool, cold = self.pool, self.cold
        pack_s = self.load_pack_s + (cold.pack_s if cold else 0.0)
        write_s = self.load_write_s + (cold.write_s if cold else 0.0)
        counters = PoolCounters(
            page_loads=self.page_loads, page_evictions=self.page_evictions,
            page_loads_ahead=self.page_loads_ahead, load_pack_s=round(pack_s, 4),
            load_write_s=round(write_s, 4), adapter_pages=pool.pages_held,
            total_pages=pool.pages[0].shape[0] if pool.pages else 0,
            page_size=pool.layout.page_size if pool.layout else 0,
            peak_batch_adapters=pool.peak_batch_adapters, adapter_steps=pool.adapter_steps,
            adapter_step_adapters=pool.adapter_step_adapters,
            adapter_step_ranks=pool.adapter_step_ranks,
            adapter_step_bytes=pool.adapter_step_bytes, host_bytes=host_bytes,
            host_adapters=len(host_ids), host_budget=self.host.budget,
            prefetch_hits=self.prefetch_hits, prefetch_misses=self.prefetch_misses,
            host_overflow_loads=self.host_overflow_loads, cold_start=self.cold_start,
            pipelined_groups=cold.pipelined_groups if cold else 0,
            assisted_groups=cold.assisted_groups if cold else 0,
            cpu_assist_workers=cold.assist_workers if cold else 0,
            sync_free_jobs=cold.sync_free_jobs if cold else 0,
            reader_processes=len(self._files.pids) if self._files else 0,
            reader_reads=self._files.reads if self._files else 0,
            reader_respawns=self._files.respawns if self._files else 0,
            read_paused_s=round(self.read_gate.paused_s, 4) if self.read_gate else 0.0)
        return ResidencyReport(
            gpu=tuple(gpu), host=tuple(sorted(set(host_ids) - set(gpu))), events=events,
            dropped_events=self.dropped_events, pages={i: pool.pages_of(i) for i in gpu},
            adapter_waits=waits, pool=counters)
