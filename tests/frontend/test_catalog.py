"""The API server's adapter catalogue."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from vllm_loraserve.adapters.peft import ModelLoRAInfo, write_adapter
from vllm_loraserve.frontend.catalog import AdapterCatalog

MODEL = ModelLoRAInfo({"q_proj": frozenset({(8, 8)})}, max_rank=8)


def _adapter(path, rank=4):
    w = {"model.layers.0.self_attn.q_proj": (torch.ones(rank, 8), torch.ones(8, rank))}
    write_adapter(str(path), w, rank=rank, alpha=2 * rank, base_model="b")
    return str(path)


def _catalog():
    calls = []

    async def fetch():
        calls.append(1)
        return MODEL

    return AdapterCatalog(fetch, torch.finfo(torch.bfloat16).max), calls


def test_admit_valid_and_invalid(tmp_path):
    cat, calls = _catalog()
    ok = asyncio.run(cat.admit("ok", _adapter(tmp_path / "ok"), "runtime"))
    bad = asyncio.run(cat.admit("big", _adapter(tmp_path / "big", rank=16), "adapter-dir"))
    assert ok.spec is not None and ok.error is None
    assert bad.spec is None and "rank 16" in bad.error
    assert cat.invalid_reason("big") == bad.error and cat.invalid_reason("ok") is None
    assert calls == [1]  # the model is asked once
    assert cat.counts() == {"disk": 1, "host": 0, "device": 0, "invalid": 1}
    assert bad.to_json([])["status"] == "invalid" and ok.to_json([])["rank"] == 4


def test_listing_shows_paths_relative_to_their_root(tmp_path):
    """The listing does not give away where adapters lie on the server: not
    in `path`, not in an invalid adapter's error."""
    cat, _ = _catalog()
    root = tmp_path / "adapters"
    ok = asyncio.run(cat.admit("ok", _adapter(root / "team" / "ok"), "runtime"))
    os.remove(_adapter(root / "broken") + "/adapter_config.json")
    bad = asyncio.run(cat.admit("broken", str(root / "broken"), "adapter-dir"))
    assert str(root) in bad.error  # the log keeps the full path
    assert ok.to_json([str(root)])["path"] == os.path.join("team", "ok")
    shown = bad.to_json([str(root)])
    assert shown["path"] == "broken" and str(tmp_path) not in shown["error"]
    assert "adapter_config.json is missing in broken" in shown["error"]
    assert ok.to_json([])["path"] == "ok"  # under no root: the directory's name


def test_refused_replacement_keeps_served_version(tmp_path):
    cat, _ = _catalog()
    asyncio.run(cat.admit("a", _adapter(tmp_path / "v1"), "runtime"))
    cat.bind("a", 7)
    refused = asyncio.run(cat.admit("a", _adapter(tmp_path / "v2", rank=16), "runtime"))
    assert refused.error is not None
    assert cat.entries["a"].spec is not None and cat.entries["a"].lora_int_id == 7


def test_residency_and_ids(tmp_path):
    cat, _ = _catalog()
    for i, name in enumerate(["a", "b", "c"]):
        asyncio.run(cat.admit(name, _adapter(tmp_path / name), "adapter-dir"))
        cat.bind(name, i + 1)
    cat.update_residency(device_ids=[1], host_ids=[2, 99])
    assert [cat.entries[n].residency for n in "abc"] == ["device", "host", "disk"]
    assert cat.name_of(2) == "b" and cat.name_of(99) is None
    assert cat.orphans == [{"lora_int_id": 99, "name": None, "residency": "host"}]
    cat.forget("b")
    assert "b" not in cat.entries


def test_resident_copies_of_unloaded_adapters_are_orphans(tmp_path):
    cat, _ = _catalog()
    asyncio.run(cat.admit("a", _adapter(tmp_path / "a"), "runtime"))
    cat.bind("a", 1)
    cat.update_residency(device_ids=[1], host_ids=[], pages={1: 3})
    assert cat.orphans == []
    cat.forget("a")
    cat.update_residency(device_ids=[1], host_ids=[], pages={1: 3})
    assert cat.orphans == [{"lora_int_id": 1, "name": "a", "residency": "device", "pages": 3}]


def test_line_locks_serialise_one_key_and_are_dropped_after_use():
    async def body():
        cat, _ = _catalog()
        order = []

        async def op(key, tag):
            async with cat.line_locks.hold(key):
                order.append(f"{tag}+")
                await asyncio.sleep(0.01)
                order.append(f"{tag}-")

        await asyncio.gather(op("x", "a"), op("x", "b"), op("y", "c"))
        # a and b never overlap; c (another line) runs beside them
        assert order.index("a-") < order.index("b+") and order.index("c+") < order.index("a-")
        assert cat.line_locks._locks == {} and cat.line_locks._users == {}

    asyncio.run(body())


def test_unloaded_ids_keep_their_name_boundedly(tmp_path, monkeypatch):
    """Load events drained after an unload still name the adapter (not
    `lora-id-N`), and the memory of retired ids is bounded."""
    from vllm_loraserve.frontend import catalog as catalog_module

    monkeypatch.setattr(catalog_module, "MAX_RETIRED_IDS", 3)
    cat, _ = _catalog()
    path = _adapter(tmp_path / "a")
    for lora_id in range(1, 6):  # load, unload, reload: a new id each time
        asyncio.run(cat.admit("a", path, "runtime"))
        cat.bind("a", lora_id)
        cat.forget("a")
    assert [cat.name_of(i) for i in range(1, 6)] == [None, None, "a", "a", "a"]


def _nan_adapter(path):
    w = {"model.layers.0.self_attn.q_proj": (torch.full((4, 8), float("nan")),
                                              torch.ones(8, 4))}
    write_adapter(str(path), w, rank=4, alpha=8, base_model="b")
    return str(path)


def test_non_finite_weights_are_refused(tmp_path):
    cat, _ = _catalog()
    entry = asyncio.run(cat.inspect("n", _nan_adapter(tmp_path / "n"), "runtime",
                                    read_weights=True))
    assert entry.spec is None and "non-finite values" in entry.error
    assert "n" not in cat.entries  # inspect records nothing


def test_directory_adapter_weights_are_read_on_first_use(tmp_path):
    cat, _ = _catalog()
    asyncio.run(cat.admit("n", _nan_adapter(tmp_path / "n"), "adapter-dir"))
    asyncio.run(cat.admit("ok", _adapter(tmp_path / "ok"), "adapter-dir"))
    assert cat.entries["n"].spec is not None  # header only so far

    async def first_requests():
        return await asyncio.gather(*(cat.check_weights(n) for n in ("n", "n", "ok")))

    bad, again, ok = asyncio.run(first_requests())
    assert "non-finite values" in bad and bad == again and ok is None
    assert cat.entries["n"].spec is None and cat.invalid_reason("n") == bad
    assert cat.entries["ok"].weights_checked



def test_a_paged_pool_catalogue_reads_no_tensor(tmp_path, monkeypatch):
    """With the paged pool (no `max_weight`) the workers check the tensors as
    they read them: the catalogue reads none, at a runtime load or on a
    directory adapter's first request, and a NaN adapter stays servable
    here (its worker refuses it, worker/paged_manager.py `_read_file`)."""
    from vllm_loraserve.frontend import catalog as catalog_module

    def no_read(spec, max_value):
        raise AssertionError(f"the API server read {spec.path}'s tensors")

    monkeypatch.setattr(catalog_module, "check_finite_weights", no_read)

    async def fetch():
        return MODEL

    cat = AdapterCatalog(fetch, None)
    entry = asyncio.run(cat.inspect("n", _nan_adapter(tmp_path / "n"), "runtime",
                                    read_weights=True))
    assert entry.error is None and entry.spec is not None
    asyncio.run(cat.admit("d", _nan_adapter(tmp_path / "d"), "adapter-dir"))
    assert asyncio.run(cat.check_weights("d")) is None
    assert cat.entries["d"].spec is not None


def test_vllm_pool_checks_run_on_the_catalogues_own_threads(tmp_path, monkeypatch):
    """`--loraserve-pool vllm`: the catalogue reads the tensors, neither on the
    event loop nor on its default thread pool."""
    from vllm_loraserve.frontend import catalog as catalog_module

    threads = []
    check = catalog_module.check_finite_weights

    def recorded(spec, max_value):
        threads.append(threading.current_thread().name)
        return check(spec, max_value)

    monkeypatch.setattr(catalog_module, "check_finite_weights", recorded)
    cat, _ = _catalog()
    entry = asyncio.run(cat.inspect("n", _nan_adapter(tmp_path / "n"), "runtime",
                                    read_weights=True))
    assert "non-finite values" in entry.error
    asyncio.run(cat.admit("ok", _adapter(tmp_path / "ok"), "adapter-dir"))
    assert asyncio.run(cat.check_weights("ok")) is None
    assert len(threads) == 2 and all(t.startswith("loraserve-check") for t in threads), threads


def test_a_check_that_fails_for_another_reason_is_tried_again(tmp_path, monkeypatch):
    """An I/O error while reading the tensors says nothing about the adapter:
    WeightsUnchecked (a 503), the entry stays unchecked and servable, and the
    next request reads again (and finds the NaN)."""
    from vllm_loraserve.frontend import catalog as catalog_module

    check = catalog_module.check_finite_weights
    calls = []

    def flaky(spec, max_value):
        calls.append(spec.path)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return check(spec, max_value)

    monkeypatch.setattr(catalog_module, "check_finite_weights", flaky)
    cat, _ = _catalog()
    asyncio.run(cat.admit("n", _nan_adapter(tmp_path / "n"), "adapter-dir"))
    with pytest.raises(catalog_module.WeightsUnchecked, match="OSError: .*Input/output error"):
        asyncio.run(cat.check_weights("n"))
    entry = cat.entries["n"]
    assert entry.spec is not None and not entry.weights_checked
    assert "non-finite values" in asyncio.run(cat.check_weights("n"))
    assert len(calls) == 2 and entry.weights_checked and cat.invalid_reason("n")


def test_scaling_is_checked_in_the_serving_dtype(tmp_path):
    """B * scaling must be finite in the dtype the catalogue was made for:
    alpha 1e6 is fine in bf16, refused by an fp16 server."""
    path = str(tmp_path / "a")
    w = {"model.layers.0.self_attn.q_proj": (torch.ones(4, 8), torch.ones(8, 4))}
    write_adapter(path, w, rank=4, alpha=1e6, base_model="b")

    async def fetch():
        return MODEL

    for dtype, error in ((torch.bfloat16, None), (torch.float16, "is above 6.55e+04")):
        cat = AdapterCatalog(fetch, torch.finfo(dtype).max)
        entry = asyncio.run(cat.inspect("a", path, "runtime", read_weights=True))
        assert entry.error is None if error is None else error in entry.error
        asyncio.run(cat.admit("a", path, "adapter-dir"))  # a directory's: on first use
        assert asyncio.run(cat.check_weights("a")) == entry.error
