"""vLLM keys its compile cache by `VllmConfig.compute_hash`; with the plugin,
its config counts there by the fields that can change the compiled model
only (config.COMPILE_FIELDS)."""

from __future__ import annotations

import dataclasses

from vllm.config import VllmConfig

from vllm_loraserve._patching import original
from vllm_loraserve.config import COMPILE_FIELDS, RUNTIME_FIELDS, LoraServeConfig
from vllm_loraserve.worker import hooks


def test_every_field_is_a_compile_or_a_runtime_field():
    names = sorted(f.name for f in dataclasses.fields(LoraServeConfig))
    assert names == sorted(COMPILE_FIELDS + RUNTIME_FIELDS)
    assert not set(COMPILE_FIELDS) & set(RUNTIME_FIELDS)


def _config(**loraserve) -> VllmConfig:
    return VllmConfig(additional_config={"loraserve": loraserve})


def test_runtime_fields_leave_the_compile_cache_key_alone():
    hooks.install()
    base = _config().compute_hash()
    runtime = _config(adapter_dirs=["/srv/a"], allowed_roots=["/srv"],
                      host_cache_bytes=1 << 30, read_threads=2, cold_start="cpu-assist",
                      cold_start_group_layers=2, cpu_assist_workers=3)
    assert runtime.compute_hash() == base
    assert _config(**LoraServeConfig().to_dict()).compute_hash() == base  # defaults spelled out
    for changed in (dict(pool="vllm"), dict(kernel="torch"), dict(max_slots=64),
                    dict(model_runner="auto")):
        assert _config(**changed).compute_hash() != base, changed
    # The plugin's key still counts, and the config itself is left as it was.
    assert VllmConfig().compute_hash() != base
    assert runtime.additional_config == {"loraserve": {
        "adapter_dirs": ["/srv/a"], "allowed_roots": ["/srv"], "host_cache_bytes": 1 << 30,
        "read_threads": 2, "cold_start": "cpu-assist", "cold_start_group_layers": 2,
        "cpu_assist_workers": 3}}
    # Without the plugin's key, vLLM's own hash.
    plain = VllmConfig(additional_config={"other": 1})
    assert plain.compute_hash() == original(VllmConfig.compute_hash)(plain)
