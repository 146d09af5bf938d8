"""The router-engine contract on the engine side: `Engine.load` branches on
the plugin's typed errors (frontend/errors.py), never on message text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from vllm_loraserve.cluster.engine import AdapterRejected, Engine, EngineSpec
from vllm_loraserve.cluster.engine_plan import EnginePlan
from vllm_loraserve.frontend import errors


def _engine(tmp_path, status: int, body: dict | str) -> Engine:
    engine = Engine(EngineSpec(EnginePlan(0, str(tmp_path), "cpu", None), model="m"))
    engine.url = "http://engine"

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/load_lora_adapter"
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    engine._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return engine


def _load(engine: Engine, adapter: str = "a") -> None:
    asyncio.run(engine.load(adapter))


def _error(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message, "code": 400}}


def test_already_loaded_is_success_by_its_type(tmp_path):
    _load(_engine(tmp_path, 400, _error(errors.ADAPTER_LOADED, "any wording at all")))


def test_invalid_adapter_is_rejected_with_the_reason(tmp_path):
    engine = _engine(tmp_path, 400, _error(
        errors.ADAPTER_INVALID, "LoRA adapter 'a' cannot be served: rank 256 above 128"))
    with pytest.raises(AdapterRejected) as e:
        _load(engine)
    assert str(e.value) == "rank 256 above 128"


def test_message_text_alone_decides_nothing(tmp_path):
    # vLLM's English duplicate message under another type is a refusal, not success
    engine = _engine(tmp_path, 400, _error(
        "BadRequestError", "The lora adapter 'a' has already been loaded."))
    with pytest.raises(AdapterRejected, match="has already been loaded"):
        _load(engine)
    with pytest.raises(AdapterRejected, match="not json"):
        _load(_engine(tmp_path, 400, "not json"))


def test_other_failures_are_not_rejections(tmp_path):
    with pytest.raises(RuntimeError, match="HTTP 500") as e:
        _load(_engine(tmp_path, 500, _error("InternalServerError", "boom")))
    assert not isinstance(e.value, AdapterRejected)
