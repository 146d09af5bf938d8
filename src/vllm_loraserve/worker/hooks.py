"""Worker-process patches: the one place where the plugin joins a worker.

`LoRAModelRunnerMixin.load_lora_model` is where every model runner (GPU V1,
GPU V2, CPU) creates its LoRA manager (vllm/v1/worker/lora_model_runner_mixin.py,
identical in 0.26 and 0.27). Only when the plugin is active for this engine:
- with the paged pool, `PagedWorkerLoRAManager` replaces vLLM's manager;
  `initialize_kv_cache` then binds it to the KV cache, `execute_model`
  applies the scheduler's page decisions before each forward pass, and the
  step's output (from `execute_model` or `sample_tokens`) carries the
  worker's `PoolReport` back to the scheduler;
- with `--loraserve-pool vllm`, vLLM's manager stays, the residency tracker
  watches it and, on the CPU platform, the no-adapter fix for the CPU LoRA
  ops is installed.
With `--loraserve-cold-start cpu-assist`, a step whose cold adapters are
CPU-assisted is run eagerly: vLLM's V1 runner decides each step's CUDA
graph mode in `_determine_batch_execution_and_padding`, whose `force_eager`
(vLLM's own, for profiling and warm-up runs) the patch sets for that step.
The V1 runner classes are patched (the CPU runner subclasses GPU V1). With
the pool, vLLM is kept on its V1 runner (`--loraserve-model-runner v1`, the
default): `VllmConfig` lists the pool among the features its V2 runner
lacks, so vLLM logs that and picks V1. With `auto` (experimental: on an
H200, 3% faster than V1 at one adapter, 7% slower at 1000) vLLM picks as it
would without the plugin, and the V2 runner's `initialize_kv_cache`,
`execute_model` and `sample_tokens` are wrapped as V1's are. V2 differs in
two places: its own dummy runs (profile, warm-up, data-parallel padding) go
through `execute_model`, and pass through untouched; and its one switch to
run a step eagerly is `is_profile` (read only for `need_eager`), which a
CPU-assisted step sets. V2's patches go in only where V2 is as
compat.V2_CONTRACT expects (else the pool stays on V1, and `auto` is
refused); with `v1`, a config for which vLLM takes V2 anyway
(VLLM_USE_V2_MODEL_RUNNER, some speculative methods) is refused at the KV
cache's binding.
`VllmConfig.compute_hash`, which keys vLLM's compile cache, counts the
plugin's config by its compile key only (config.COMPILE_FIELDS).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import time

from vllm_loraserve._patching import wrap
from vllm_loraserve.config import ADDITIONAL_CONFIG_KEY, LoraServeConfig, from_vllm_config

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format


def _make_load_lora_model(load_lora_model):
    def patched(self, model, vllm_config, device):
        cfg = from_vllm_config(vllm_config)
        if cfg is not None and cfg.pool == "paged":
            return _load_paged(self, model, vllm_config, device, cfg)
        lora_model = load_lora_model(self, model, vllm_config, device)
        if cfg is None:
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


def _load_paged(runner, model, vllm_config, device, cfg):
    from vllm.model_executor.models import supports_lora

    from vllm_loraserve.worker.extension import TRACKER_ATTR
    from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

    if not supports_lora(model):
        raise ValueError(f"{model.__class__.__name__} does not support LoRA yet.")
    runner.lora_manager = PagedWorkerLoRAManager(vllm_config, device, model.embedding_modules,
                                                 cfg)
    setattr(runner, TRACKER_ATTR, runner.lora_manager)
    return runner.lora_manager.create_lora_manager(model, vllm_config)


def _paged_manager(runner):
    from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

    manager = getattr(runner, "lora_manager", None)
    return manager if isinstance(manager, PagedWorkerLoRAManager) else None


def _make_initialize_kv_cache(initialize_kv_cache, runner: str = "V1"):
    def patched(self, kv_cache_config, *a, **kw):
        manager = _paged_manager(self)
        if manager is not None and runner != "V1":
            if manager.cfg.model_runner == "v1":
                # vLLM takes V2 before it asks what V2 lacks in some configs
                # (VLLM_USE_V2_MODEL_RUNNER, some speculative methods).
                raise ValueError("vLLM chose its V2 model runner for this config, and the "
                                 "loraserve pool runs on V1 (--loraserve-model-runner v1); "
                                 "--loraserve-model-runner auto runs it on V2, experimental")
            logger.warning("vllm-loraserve: the paged pool runs on vLLM's %s model runner: "
                           "experimental, slower than V1 with many adapters", runner)
        out = initialize_kv_cache(self, kv_cache_config, *a, **kw)
        if manager is not None and self.kv_caches:
            manager.bind_kv_cache(self.kv_caches)
        return out

    return patched


def _with_report(manager, out):
    """Put the worker's `PoolReport` on the step's output for the scheduler.
    vLLM returns a shared empty output for token-less steps, so that one is
    copied first; an async output gets it when it is resolved."""
    if out is None:  # sample_tokens() brings the output
        return out
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    from vllm_loraserve.paging.step import REPORT_ATTR

    if isinstance(out, AsyncModelRunnerOutput):
        get_output = out.get_output

        def get_output_with_report():
            return _with_report(manager, get_output())

        out.get_output = get_output_with_report
        return out
    if out is EMPTY_MODEL_RUNNER_OUTPUT:
        out = copy.copy(out)
    setattr(out, REPORT_ATTR, manager.report())
    return out


def _run_step(manager, scheduler_output, forward):
    """A runner's step with the pool: the scheduler's page decisions first,
    then `forward()` (the runner's own execute_model), the forward's end, and
    the PoolReport on its output; a line of the step trace where it is on."""
    from vllm_loraserve.paging.step import STEP_ATTR

    start, cpu0 = time.monotonic(), time.thread_time()
    tokens = scheduler_output.total_num_scheduled_tokens
    manager.apply_step(getattr(scheduler_output, STEP_ATTR, None), idle=tokens == 0)
    applied, applied_cpu = time.monotonic(), time.thread_time()
    gate = manager.read_gate  # None with --loraserve-read-pause off
    try:
        with gate.closed() if gate is not None else contextlib.nullcontext():
            out = forward()  # reads park at their checkpoints meanwhile
    finally:
        manager.end_forward()  # before the report: a load may fail in the forward pass
    if manager.step_trace is not None:
        manager.step_trace.record(start, applied, time.monotonic(),
                                  (cpu0, applied_cpu, time.thread_time()), tokens,
                                  manager.trace_counts())
    return _with_report(manager, out)


def _make_execute_model(execute_model):
    def patched(self, scheduler_output, *a, **kw):
        manager = _paged_manager(self)
        if manager is None:
            return execute_model(self, scheduler_output, *a, **kw)
        return _run_step(manager, scheduler_output,
                         lambda: execute_model(self, scheduler_output, *a, **kw))

    return patched


def _make_execute_model_v2(execute_model):
    signature = inspect.signature(execute_model)

    def patched(self, *a, **kw):
        manager = _paged_manager(self)
        if manager is None:
            return execute_model(self, *a, **kw)
        bound = signature.bind(self, *a, **kw)
        if bound.arguments.get("dummy_run"):
            # V2's own dummy runs come through here; they carry no step.
            return execute_model(*bound.args, **bound.kwargs)

        def forward():
            if manager.force_eager:  # known once the step is applied
                bound.arguments["is_profile"] = True  # V2's only eager switch (need_eager)
            return execute_model(*bound.args, **bound.kwargs)

        return _run_step(manager, bound.arguments["scheduler_output"], forward)

    return patched


def _make_sample_tokens(sample_tokens):
    def patched(self, *a, **kw):
        out = sample_tokens(self, *a, **kw)
        manager = _paged_manager(self)
        return out if manager is None else _with_report(manager, out)

    return patched


def _make_determine_batch_execution(determine):
    def patched(self, *a, **kw):
        manager = _paged_manager(self)
        if manager is not None and manager.force_eager:
            kw["force_eager"] = True
        return determine(self, *a, **kw)

    return patched


def _make_v2_unsupported(unsupported_features):
    def patched(self):
        out = unsupported_features(self)
        cfg = from_vllm_config(self)
        if cfg is not None and cfg.pool == "paged" and cfg.model_runner == "v1":
            out = [*out, "the loraserve paged pool (--loraserve-model-runner v1)"]
        return out

    return patched


def _make_compute_hash(compute_hash):
    def patched(self):
        extra = self.additional_config
        if not isinstance(extra, dict) or ADDITIONAL_CONFIG_KEY not in extra:
            return compute_hash(self)
        # vLLM keys its compile cache by this hash, and hashes additional_config
        # whole: the plugin's part counts by its compile key alone (a shallow
        # copy of the config, so nothing else sees the swap).
        keyed = copy.copy(self)
        key = LoraServeConfig.from_dict(extra[ADDITIONAL_CONFIG_KEY]).compile_key()
        keyed.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: key}
        return compute_hash(keyed)

    return patched


def install() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from vllm_loraserve.compat import V2_CONTRACT, contract_problems

    wrap(VllmConfig, "_get_v2_model_runner_unsupported_features", _make_v2_unsupported)
    wrap(VllmConfig, "compute_hash", _make_compute_hash)
    wrap(LoRAModelRunnerMixin, "load_lora_model", _make_load_lora_model)
    wrap(GPUModelRunner, "initialize_kv_cache", _make_initialize_kv_cache)
    wrap(GPUModelRunner, "execute_model", _make_execute_model)
    wrap(GPUModelRunner, "sample_tokens", _make_sample_tokens)
    wrap(GPUModelRunner, "_determine_batch_execution_and_padding",
         _make_determine_batch_execution)
    problems = contract_problems(V2_CONTRACT)
    if problems:  # the pool stays on V1; `auto` is refused (frontend/args.py)
        logger.warning("vllm-loraserve: vLLM's V2 model runner moved, so the pool runs on "
                       "V1 only: %s", "; ".join(problems))
        return
    from vllm.v1.worker.gpu import model_runner as v2

    wrap(v2.GPUModelRunner, "initialize_kv_cache", lambda f: _make_initialize_kv_cache(f, "V2"))
    wrap(v2.GPUModelRunner, "execute_model", _make_execute_model_v2)
    wrap(v2.GPUModelRunner, "sample_tokens", _make_sample_tokens)
