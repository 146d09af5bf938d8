"""The plugin's configuration: one typed, documented dataclass.

It reaches vLLM as `additional_config["loraserve"]` (a plain dict, so it
travels to the engine core and workers inside `VllmConfig`). `--plugin
loraserve --loraserve-*` on the `vllm serve` command line fills that dict
(frontend/args.py); Python users pass it directly:

    LLM(model, enable_lora=True, additional_config={"loraserve": {}})

The presence of the key is what activates the plugin: an installed plugin
without it changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

ADDITIONAL_CONFIG_KEY = "loraserve"
# The fields that can change what torch.compile sees: only these key vLLM's
# compile cache (worker/hooks.py), so a server started with other adapter
# directories or another host budget reuses the compiled model. Every other
# field is read at run time only (RUNTIME_FIELDS); a new field must join one
# of the two (tests/worker/test_compile_key.py). The cold-start fields are
# runtime fields: what a mode does happens inside the pool's custom op, which
# is opaque to torch.compile (worker/paged_layer.py), and CUDA graphs, which
# the mode does change, are captured anew at every start, never cached. The
# model runner is a compile field: the two runners need not trace the same
# graph, and their caches must not be taken for each other's.
COMPILE_FIELDS = ("pool", "kernel", "max_slots", "model_runner")
RUNTIME_FIELDS = ("adapter_dirs", "allowed_roots", "host_cache_bytes", "read_threads", "read_in",
                  "read_pause", "read_pause_reads", "pack", "tiles",
                  "cold_start", "cold_start_group_layers", "cpu_assist_workers")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A field with its user-facing doc; frontend/args.py turns it into a flag."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class LoraServeConfig:
    adapter_dirs: list[str] = _opt(
        [],
        "Directory whose sub-directories are PEFT LoRA adapters, each served "
        "under its sub-directory name. Adapters are validated at start-up and "
        "read from disk on their first request. Repeatable.",
        flag="--loraserve-adapter-dir",
        action="append",
    )
    allowed_roots: list[str] = _opt(
        [],
        "Directory under which runtime /v1/load_lora_adapter may read adapters "
        "(besides the --loraserve-adapter-dir directories). A path outside every "
        "root, also through '..' or a symlink, gets HTTP 403. Repeatable.",
        flag="--loraserve-allowed-root",
        action="append",
    )
    pool: str = _opt(
        "paged",
        "Where adapter weights live on the device. 'paged': in pages of the KV "
        "cache, each adapter at its true rank, computed by the paged kernels, with "
        "no cap on distinct adapters per batch (the default). 'vllm': vLLM's own "
        "LoRA slots (padded to --max-lora-rank, at most --max-loras per batch).",
        flag="--loraserve-pool",
        choices=("paged", "vllm"),
    )
    host_cache_bytes: int = _opt(
        0,
        "Byte budget of the paged pool's host tier (per worker): adapters read "
        "from disk are kept in host memory, least recently used evicted first "
        "(those waiting requests still need last), and re-read from disk when "
        "needed again. The tier's memory is allocated (pinned, on a GPU) at "
        "start-up, in chunks of 256 MiB or the power of two that holds the "
        "largest adapter: the budget rounded down to whole chunks, at least "
        "one. 0: a quarter of the machine's memory, at most 32 GiB.",
        flag="--loraserve-host-cache-bytes",
    )
    read_threads: int = _opt(
        4,
        "Threads per worker that read adapters from disk into the host tier "
        "(prefetch for the waiting queue), and as many again that split each "
        "adapter's read and value check into pieces. Requests whose adapter "
        "is still being read wait in the queue; the batch does not.",
        flag="--loraserve-read-threads",
    )
    read_in: str = _opt(
        "threads",
        "Where the host tier's reads and value checks run. 'threads': in the "
        "engine's process, on the reader threads, whose GIL the engine thread "
        "shares. 'processes' (experimental): in as many processes as "
        "--loraserve-read-threads, which map the tier's memory (shared memory, "
        "pinned at start-up). On an H200 it cut the engine thread's page-load "
        "time 2.2x at pool-1000 (Llama-2-7B q/k/v/o), but its throughput gain "
        "was within the runs' spread, and one of its three runs stalled, "
        "unexplained (docs/benchmarks/e2e.md, session 30).",
        flag="--loraserve-read-in",
        choices=("processes", "threads"),
    )
    read_pause: str = _opt(
        "forward",
        "Whether the host tier's reads pause while the engine thread runs the "
        "model runner's step. 'forward': while two or more reads are under way, "
        "each waits at its next checkpoint (before its metadata work, before each "
        "piece of its file, after a reader process's answer) during the runner's "
        "step, so the readers, which share the engine's GIL, contend for it far "
        "less there; they go on between steps (vLLM's scheduling, the wait for a "
        "step's output). A lone read never waits. On an H200 at 1000 adapters "
        "(Llama-2-7B q/k/v/o) the gate kept 0.850, 0.848 and 0.846 of no-LoRA "
        "throughput against 0.832 and 0.838 with 'off' (docs/benchmarks/e2e.md, "
        "sessions 37-38); that gate parked lone reads too, which made online "
        "first requests 22-30 ms slower at the median. With lone reads let "
        "through: 0.846 against 0.823 with 'off' in one call, and online from "
        "disk reads of 24 / 33 ms at 1000 / 2000 adapters against 19-20 ms "
        "without a gate (session 39). 'off': reads never pause.",
        flag="--loraserve-read-pause",
        choices=("forward", "off"),
    )
    read_pause_reads: int = _opt(
        2,
        "With --loraserve-read-pause forward: how many reads must be under way "
        "for them to park (at least 2: a lone read never parks). Online, reads "
        "come a few a second and two overlap now and then, so each parked read "
        "delays an adapter's first request; the offline burst keeps every "
        "reader thread busy. Measured at 2 only (session 39: reads of 24 / 33 "
        "ms online at 1000 / 2000 adapters, against 19-20 ms without a gate).",
        flag="--loraserve-read-pause-reads",
    )
    pack: str = _opt(
        "auto",
        "How a page load packs an adapter's file into page layout on the GPU. "
        "'triton': one Triton launch per load, from a table the reader builds. "
        "'torch': a few torch calls per slice and a view per tensor, made by the "
        "engine's thread, whose GIL the readers share (6.3 ms a load at 2000 "
        "adapters on an H200, against 0.65 ms with 'triton': docs/benchmarks/e2e.md, "
        "session 23). 'auto': triton on CUDA, torch elsewhere.",
        flag="--loraserve-pack",
        choices=("auto", "torch", "triton"),
    )
    max_slots: int = _opt(
        4096,
        "Most adapters resident in the paged pool at once (the length of the "
        "per-step slot table the kernels read).",
        flag="--loraserve-max-slots",
    )
    model_runner: str = _opt(
        "v1",
        "Which of vLLM's GPU model runners serves the paged pool. 'v1': vLLM's "
        "V1 runner, which every measurement of the pool used. 'auto' "
        "(experimental; logged at start-up): vLLM's own choice, its V2 runner for "
        "dense models, as vLLM's own LoRA gets. On an H200 (docs/benchmarks/e2e.md, "
        "session 33) its throughput was 1.03x V1's with one adapter and 0.93x "
        "with 1000.",
        flag="--loraserve-model-runner",
        choices=("auto", "v1"),
    )
    kernel: str = _opt(
        "auto",
        "LoRA kernel backend of the paged pool: 'triton' (MBGMM/MBGMV), 'torch' "
        "(reference), or 'auto' (triton on CUDA, torch elsewhere).",
        flag="--loraserve-kernel",
        choices=("auto", "triton", "torch"),
    )
    tiles: str = _opt(
        "",
        "A tile table for the triton kernels (JSON), tuned before serving on "
        "the GPU that serves: benchmarks/kernels/engine_grid.py --sweep "
        "--tiles-out writes one for a model's shapes. Its tiles replace the "
        "built-in rules where it has an entry, and are compiled at start-up "
        "like them. '': the rules (tuned on an H200 at the Llama-2-7B and "
        "Llama-3-8B shapes). A table from another GPU or Triton version is used, with a warning.",
        flag="--loraserve-tiles",
    )
    cold_start: str = _opt(
        "auto",
        "How a request starts whose adapter is not in the paged pool yet (its "
        "adapter's pages are written in the step that first runs it). 'block': "
        "every layer's pages are written before that step's forward pass starts. "
        "'pipelined': they are written layer group by layer group on a side "
        "stream while the forward pass runs, and each layer waits, on the "
        "device, for its own group only. 'cpu-assist' (Toppings): as "
        "'pipelined', and until a group's pages have landed the cold adapter's "
        "LoRA delta for that group's layers is computed on the CPU from the host "
        "tier's copy and added on the device; that step runs without CUDA graphs. "
        "'auto': pipelined on CUDA (the H200 benchmark's winner: "
        "docs/benchmarks/cold-start.md), block on the CPU (no side stream) and "
        "where CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream in one hardware "
        "queue (logged at start-up).",
        flag="--loraserve-cold-start",
        choices=("auto", "block", "pipelined", "cpu-assist"),
    )
    cold_start_group_layers: int = _opt(
        4,
        "Layers per group of a 'pipelined' or 'cpu-assist' page load. A group "
        "costs a few launches on the side stream per loading adapter and one "
        "device-side wait per LoRA module of its first layer in every forward "
        "pass; smaller groups let the first layers start sooner. 4 keeps a "
        "32-layer model at 8 groups.",
        flag="--loraserve-cold-start-group-layers",
    )
    cpu_assist_workers: int = _opt(
        0,
        "'cpu-assist': CPU worker processes that compute the deltas, each pinned "
        "to its own core, fed through shared memory, with the rows split by each "
        "core's speed profiled at start-up (Toppings). 0: as many as the machine "
        "can spare beside vLLM (its engine, its GPU worker and the host tier's "
        "readers; at most 16). -1: no workers, the engine process's own threads "
        "compute them.",
        flag="--loraserve-cpu-assist-workers",
    )

    def __post_init__(self) -> None:
        for name in ("adapter_dirs", "allowed_roots"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(d, str) for d in value):
                raise ValueError(f"loraserve.{name} must be a list of paths")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"loraserve.{f.name} must be one of {list(choices)}, "
                                 f"got {getattr(self, f.name)!r}")
        for name in ("host_cache_bytes", "read_threads", "read_pause_reads", "max_slots",
                     "cold_start_group_layers", "cpu_assist_workers"):
            value = getattr(self, name)
            low = {"host_cache_bytes": 0, "cpu_assist_workers": -1, "read_pause_reads": 2}.get(
                name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"loraserve.{name} must be an integer >= {low}, got {value!r}")

        # The default (2) stands with one reader thread: a lone read passes anyway.
        if self.read_pause == "forward" and self.read_pause_reads > max(2, self.read_threads):
            raise ValueError(f"loraserve.read_pause_reads ({self.read_pause_reads}) must be at "
                             f"most read_threads ({self.read_threads}): no more reads run "
                             f"at once, so the gate would never park")
        if not isinstance(self.tiles, str):
            raise ValueError(f"loraserve.tiles must be a path, got {self.tiles!r}")
        if self.tiles:
            from vllm_loraserve.kernels.tile_table import TileTable

            TileTable.load(self.tiles)  # a bad table stops the start, with its reason

    def host_budget(self) -> int:
        """`host_cache_bytes`, with 0 resolved against this machine's memory."""
        if self.host_cache_bytes:
            return self.host_cache_bytes
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(memory // 4, 32 << 30)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> LoraServeConfig:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"unknown loraserve option(s) {unknown}; valid options: {sorted(known)}"
            )
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def compile_key(self) -> dict[str, Any]:
        """What of this config keys vLLM's compile cache (COMPILE_FIELDS)."""
        return {name: getattr(self, name) for name in COMPILE_FIELDS}


def from_vllm_config(vllm_config: Any) -> LoraServeConfig | None:
    """The active plugin config of a VllmConfig, or None when the plugin is off."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if ADDITIONAL_CONFIG_KEY not in extra:
        return None
    return LoraServeConfig.from_dict(extra[ADDITIONAL_CONFIG_KEY])
