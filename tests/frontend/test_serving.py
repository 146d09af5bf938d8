"""The API-server patches of frontend/serving.py, on a stand-in for vLLM's
adapter registry (`OpenAIServingModels`)."""

from __future__ import annotations

import asyncio
import logging
import os
from types import SimpleNamespace

import torch

from vllm_loraserve.adapters.directory import MAX_LOGGED_INVALID
from vllm_loraserve.adapters.peft import write_adapter
from vllm_loraserve.frontend import serving
from vllm_loraserve.frontend.serving import catalog_of
from vllm_loraserve.paging.step import TRANSIENT_NOTE


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, k: int) -> int:
        self.n += k
        return self.n


def _models(adapter_dirs):
    async def collective_rpc(method):
        assert method == "loraserve_lora_modules"
        return [{"shapes": {"q_proj": [(8, 8)]},
                 "modules": ["model.layers.0.self_attn.q_proj"]}]

    vllm_config = SimpleNamespace(
        additional_config={"loraserve": {"adapter_dirs": [str(d) for d in adapter_dirs]}},
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=torch.bfloat16))
    return SimpleNamespace(
        engine_client=SimpleNamespace(vllm_config=vllm_config, collective_rpc=collective_rpc),
        static_lora_modules=[], base_model_paths=[SimpleNamespace(name="base")],
        lora_id_counter=_Counter(), lora_requests={})


def _adapter(path, rank=4):
    w = {"model.layers.0.self_attn.q_proj": (torch.ones(rank, 8), torch.ones(8, rank))}
    write_adapter(str(path), w, rank=rank, alpha=2 * rank, base_model="b")


def _start(models, caplog):
    async def unpatched(self):
        raise AssertionError("the plugin's start-up runs instead")

    # vLLM's logger does not propagate to the root logger that caplog
    # listens on (unless an earlier test configured logging): listen on it,
    # once vLLM's logging set-up (at its first import) has cleared the
    # handlers of the vllm.* loggers.
    import vllm.logger  # noqa: F401

    serving.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=serving.logger.name):
            asyncio.run(serving._make_init_static_loras(unpatched)(models))
    finally:
        serving.logger.removeHandler(caplog.handler)
    # A record seen twice (here and through the root logger, when an earlier
    # test made vLLM's loggers propagate) is one record: the same object.
    return [r.getMessage() for r in {id(r): r for r in caplog.records}.values()]


def test_start_up_logs_each_invalid_adapter_with_its_reason_capped(tmp_path, caplog):
    """'N ready, M invalid', then one line per invalid adapter naming it and
    why, at most MAX_LOGGED_INVALID, then a count of the rest; a malformed
    config (nested too deep for the JSON parser) or a file symlinked out of
    the adapter directory is one of them, and start-up goes on."""
    root = tmp_path / "adapters"
    for i in range(3):
        _adapter(root / f"good-{i}")
    n_bad = MAX_LOGGED_INVALID + 5
    for i in range(n_bad - 2):
        _adapter(root / f"big-{i:02}", rank=16)  # above the server's rank 8
    _adapter(root / "a-deep")
    (root / "a-deep" / "adapter_config.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    _adapter(tmp_path / "outside")
    _adapter(root / "a-file-link")
    os.remove(root / "a-file-link" / "adapter_model.safetensors")
    os.symlink(tmp_path / "outside" / "adapter_model.safetensors",
               root / "a-file-link" / "adapter_model.safetensors")
    models = _models([root])
    messages = _start(models, caplog)

    assert f"vllm-loraserve catalogue: 3 adapters ready, {n_bad} invalid" in messages
    named = [m for m in messages if m.startswith("adapter '")]
    assert len(named) == MAX_LOGGED_INVALID
    assert "adapter 'big-00' is not served: rank 16 is above this server's maximum LoRA " \
        "rank 8 (--max-lora-rank)" in named
    assert any(m.startswith("adapter 'a-deep' is not served: adapter_config.json in ")
               and "not valid JSON: RecursionError" in m for m in named)
    assert any(m.startswith("adapter 'a-file-link' is not served: ")
               and "its file 'adapter_model.safetensors' resolves to" in m
               and "outside the adapter roots" in m for m in named)
    assert messages[-1] == "... and 5 more invalid adapters"
    catalog = catalog_of(models)
    assert sorted(models.lora_requests) == ["good-0", "good-1", "good-2"]
    assert catalog.entries["a-file-link"].to_json([])["status"] == "invalid"
    assert catalog.counts()["invalid"] == n_bad


def test_a_workers_refusal_reaches_the_client_unwrapped():
    """A runtime load the worker's read refused (NaN weights): the 400 says
    the worker's reason, not vLLM's wrapping of it (engine-core utility call,
    multiprocess executor), whose "stack trace above" is in the server's log."""
    reason = "tensor lora_A of model.layers.0.mlp.down_proj holds non-finite values (NaN or Inf)"
    for message in (
            f"Call to add_lora method failed: {reason}",
            f"Call to add_lora method failed: Worker failed with error '{reason}', please "
            "check the stack trace above for the root cause"):
        assert serving._worker_reason(message) == reason
    assert serving._worker_reason("something else") == "something else"


def test_an_engine_failure_marks_the_adapter_invalid_unless_transient():
    """The engine failed a request's adapter: its error names the reason,
    and the catalogue marks the adapter invalid, unless the worker said the
    failure was transient (an I/O error: the next request loads it again)."""
    from vllm.exceptions import VLLMValidationError

    class Catalog:
        def __init__(self):
            self.entries, self.rejected = {"a": SimpleNamespace(spec=object())}, []

        def reject(self, name, reason):
            self.rejected.append(reason)

    catalog = Catalog()
    serving._CATALOGS.add(catalog)
    eio = f"its files could not be read: OSError: [Errno 5] Input/output error{TRANSIENT_NOTE}"
    nan = "tensor lora_B of model.layers.0.self_attn.q_proj holds non-finite values (NaN or Inf)"
    try:
        for reason, rejected in ((eio, []), (nan, [nan])):
            errors = []
            serving.note_engine_failure(SimpleNamespace(lora_name="a",
                                                        queue=SimpleNamespace(put=errors.append)),
                                        reason)
            assert catalog.rejected == rejected
            assert isinstance(errors[0], VLLMValidationError) and \
                errors[0].args == (f"LoRA adapter 'a' cannot be served: {reason}",)
    finally:
        serving._CATALOGS.discard(catalog)


def test_a_load_a_dead_engine_fails_is_a_503_that_marks_no_adapter(tmp_path, caplog):
    """vLLM answers every failed add_lora with a 500, its engine's death too:
    that is not the adapter's fault, so the client (the cluster router
    included, which drops an adapter a 400 refuses) gets a 503, and the
    adapter is not recorded invalid. A live engine's refusal stays a 400."""
    from http import HTTPStatus

    from vllm_loraserve.frontend import errors

    _adapter(tmp_path / "a")
    models = _models([tmp_path])
    _start(models, caplog)
    catalog = catalog_of(models)

    async def failing_load(self, request, base_model_name=None):
        return serving._error("EngineCore encountered an issue. See stack trace (above) for "
                              "the root cause.", "InternalServerError",
                              HTTPStatus.INTERNAL_SERVER_ERROR)

    load = serving._make_load_lora_adapter(failing_load)
    for source in ("runtime", "lora-modules"):
        _adapter(tmp_path / source)
        request = SimpleNamespace(lora_name=source, lora_path=str(tmp_path / source),
                                  load_inplace=False)
        models.engine_client.errored = True
        r = asyncio.run(load(models, request, loraserve_source=source))
        assert (r.error.code, r.error.type) == (503, errors.ENGINE_UNAVAILABLE)
        assert "the engine is not running (EngineCore encountered" in r.error.message
        assert source not in catalog.entries
        models.engine_client.errored = False
        r = asyncio.run(load(models, request, loraserve_source=source))
        assert (r.error.code, r.error.type) == (400, errors.ADAPTER_INVALID)


def test_a_runtime_path_the_os_cannot_take_is_a_400_naming_lora_path(tmp_path, caplog):
    """A NUL byte: a ValueError from the path check, as the router's admin answers it."""
    models = _models([tmp_path])
    _start(models, caplog)

    async def unreachable(self, request, base_model_name=None):
        raise AssertionError("the engine was asked to load it")

    load = serving._make_load_lora_adapter(unreachable)
    request = SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "a\0b"),
                              load_inplace=False)
    r = asyncio.run(load(models, request))  # vLLM's handler said only "embedded null byte"
    assert (r.error.code, r.error.param) == (400, "lora_path")
    assert r.error.message.startswith("LoRA adapter 'x' refused: invalid lora_path")
    assert r.error.message.endswith("embedded null byte")


def test_an_adapter_directorys_versions_serve_their_alias_newest_first(tmp_path, caplog):
    """`x@500` and `x@1000` in an adapter directory (listed `x@1000` first):
    `x` serves `x@1000`, and ids follow the versions, so an unload of it
    moves `x` to `x@500`; a plain `y` keeps its name beside `y@2`."""
    root = tmp_path / "adapters"
    for name in ("x@1000", "x@500", "y", "y@2"):
        _adapter(root / name)
    models = _models([root])
    _start(models, caplog)

    r = models.lora_requests
    assert r["x"] is r["x@1000"]
    assert r["x@500"].lora_int_id < r["x@1000"].lora_int_id
    assert r["y"].lora_name == "y"
    del r["x@1000"]
    catalog_of(models).entries.pop("x@1000")
    serving._repoint_alias(models, catalog_of(models), "x@1000")
    assert r["x"] is r["x@500"]
