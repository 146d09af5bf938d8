"""RPC methods the API server calls on workers (`collective_rpc`).

Set as vLLM's `worker_extension_cls` when the plugin is active (see
frontend/args.py); vLLM mixes it into the worker class. Names carry the
`loraserve_` prefix because vLLM refuses extension attributes that clash with
the worker's own.
"""

from __future__ import annotations

from typing import Any

from vllm_loraserve.worker.report import ResidencyReport
from vllm_loraserve.worker.residency import lora_modules

TRACKER_ATTR = "_loraserve_tracker"


class LoraServeWorkerExtension:
    def _loraserve_lora_manager(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        if not hasattr(runner, "lora_manager"):
            raise RuntimeError("vllm-loraserve needs --enable-lora")
        return runner.lora_manager

    def loraserve_lora_modules(self) -> dict[str, Any]:
        """What adapters may target (module paths, shapes), for adapter checks."""
        return lora_modules(self._loraserve_lora_manager()._adapter_manager)

    def loraserve_prefetch(self, name: str, lora_int_id: int, path: str,
                           nbytes: int) -> dict[str, Any]:
        """Start reading an adapter into this worker's host tier (the paged
        pool's `warm`): {"state": host | reading | failed | no-room, "reason"}.
        Plain arguments, not a LoRARequest: they cross the executor's wire."""
        from vllm.lora.request import LoRARequest

        manager = self._loraserve_lora_manager()
        if not hasattr(manager, "warm"):
            raise ValueError("prefetch needs the paged pool (not --loraserve-pool vllm)")
        state, reason = manager.warm(LoRARequest(name, lora_int_id, path), nbytes)
        return {"state": state, "reason": reason}

    def loraserve_residency(self) -> dict[str, Any]:
        """Adapter ids per tier and the load events since the last call: a
        `ResidencyReport` in its wire form (it leaves this process here)."""
        self._loraserve_lora_manager()
        # A ResidencyTracker, or the paged pool's manager (worker/hooks.py).
        tracker = getattr(self.model_runner, TRACKER_ATTR)  # type: ignore[attr-defined]
        report: ResidencyReport = tracker.snapshot()
        return report.to_wire()
