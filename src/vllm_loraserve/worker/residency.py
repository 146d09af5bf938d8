"""Where each adapter lives on a worker, and how long its loads took.

vLLM's worker LoRA manager keeps adapters in two tiers: a host (CPU memory)
LRU cache of `max_cpu_loras` loaded adapters, and `max_loras` device slots
that the kernels read. `ResidencyTracker` wraps the two transitions of one
manager instance (disk -> host: `_load_adapter`; host -> device:
`activate_adapter`) to time them, and reads the tiers back on demand.

Invariant: an adapter id is reported in at most one tier; a device-resident
adapter is also in the host cache and is reported as "gpu".
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from vllm_loraserve.worker.report import LoadEvent, ResidencyReport

MAX_BUFFERED_EVENTS = 10_000


class ResidencyTracker:
    def __init__(self, worker_manager: Any) -> None:
        self._wm = worker_manager
        self._events: deque[LoadEvent] = deque(maxlen=MAX_BUFFERED_EVENTS)
        self._loaded_from_disk: set[int] = set()
        self.dropped_events = 0
        self._wrap_instance()

    def _record(self, lora_id: int, tier: str, seconds: float) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped_events += 1
        self._events.append(LoadEvent(lora_id, tier, seconds))

    def _wrap_instance(self) -> None:
        wm, am = self._wm, self._wm._adapter_manager
        load, activate = wm._load_adapter, am.activate_adapter

        def timed_load(lora_request):
            t0 = time.perf_counter()
            lora = load(lora_request)
            self._record(lora_request.lora_int_id, "host", time.perf_counter() - t0)
            self._loaded_from_disk.add(lora_request.lora_int_id)
            return lora

        def timed_activate(lora_id):
            t0 = time.perf_counter()
            activated = activate(lora_id)
            # Warm-up dummy adapters never come from disk: leave them out.
            if activated and lora_id in self._loaded_from_disk:
                self._record(lora_id, "gpu", time.perf_counter() - t0)
            return activated

        wm._load_adapter = timed_load
        am.activate_adapter = timed_activate

    def snapshot(self, drain_events: bool = True) -> ResidencyReport:
        """Tiers by adapter id plus the load events since the last drain."""
        am = self._wm._adapter_manager
        gpu = tuple(sorted(int(i) for i in am._active_adapters))
        host = tuple(sorted(int(i) for i in am.list_adapters() if i not in am._active_adapters))
        events = tuple(self._events)
        if drain_events:
            self._events.clear()
        return ResidencyReport(gpu, host, events, self.dropped_events)


def lora_modules(adapter_manager: Any) -> dict[str, Any]:
    """What an adapter may target on this model, as PEFT names it:
    `{"shapes": short name -> distinct (in, out) pairs over layers,
    "modules": every full module path}` (`adapters.peft.ModelLoRAInfo.from_wire`).

    vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj; a PEFT
    adapter names the unpacked modules, so packed layers are split by their
    `output_sizes` (full, un-sharded sizes) in `packed_modules_mapping` order.
    """
    shapes: dict[str, set[tuple[int, int]]] = {}
    paths = []
    for path, shape in _peft_modules(adapter_manager):
        shapes.setdefault(path.rsplit(".", 1)[-1], set()).add(shape)
        paths.append(path)
    return {"shapes": {k: sorted(v) for k, v in sorted(shapes.items())},
            "modules": sorted(paths)}


def _peft_modules(adapter_manager: Any) -> list[tuple[str, tuple[int, int]]]:
    """(PEFT module path, (in, out)) of every module vLLM wrapped for LoRA."""
    from vllm.lora.layers import LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA

    packed = adapter_manager.packed_modules_mapping
    out = []
    for name, module in adapter_manager.modules.items():
        base = module.base_layer
        prefix, _, short = name.rpartition(".")
        prefix = prefix + "." if prefix else ""
        if isinstance(module, VocabParallelEmbeddingWithLoRA):  # lora_embedding_A [r, vocab]
            pairs = [(short, (base.org_vocab_size, base.embedding_dim))]
        elif isinstance(module, LogitsProcessorWithLoRA):  # lm_head: A [r, hidden]
            pairs = [(short, (module.hidden_size, base.org_vocab_size))]
        elif short in packed:
            outs = list(base.output_sizes)
            pairs = [(sub, (base.input_size, o))
                     for sub, o in zip(packed[short], outs, strict=True)]
        else:
            pairs = [(short, (base.input_size, base.output_size))]
        out += [(prefix + sub, shape) for sub, shape in pairs]
    return out
