"""Worker-process patch: the one place where the plugin joins a worker.

`LoRAModelRunnerMixin.load_lora_model` is where every model runner (GPU V1,
GPU V2, CPU) creates its LoRA manager (vllm/v1/worker/lora_model_runner_mixin.py,
identical in 0.26 and 0.27). The wrapper runs the original, then, only when
the plugin is active for this engine, attaches the residency tracker and, on
the CPU platform, installs the no-adapter fix for the CPU LoRA ops.
"""

from __future__ import annotations

import logging

from vllm_loraserve._patching import wrap
from vllm_loraserve.config import from_vllm_config

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format


def _make_load_lora_model(load_lora_model):
    def patched(self, model, vllm_config, device):
        lora_model = load_lora_model(self, model, vllm_config, device)
        if from_vllm_config(vllm_config) is None:
            return lora_model
        from vllm.platforms import current_platform

        from vllm_loraserve.worker.extension import TRACKER_ATTR
        from vllm_loraserve.worker.residency import ResidencyTracker

        setattr(self, TRACKER_ATTR, ResidencyTracker(self.lora_manager))
        if current_platform.is_cpu():
            from vllm_loraserve.worker import cpu_ops

            cpu_ops.install()
            logger.info("vllm-loraserve: CPU LoRA ops now skip tokens without an adapter")
        return lora_model

    return patched


def install() -> None:
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    wrap(LoRAModelRunnerMixin, "load_lora_model", _make_load_lora_model)
