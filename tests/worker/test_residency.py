"""ResidencyTracker against a stand-in for vLLM's worker LoRA manager."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_loraserve.worker import residency
from vllm_loraserve.worker.residency import ResidencyTracker


class FakeAdapterManager:
    def __init__(self):
        self.registered, self._active_adapters = [], {}

    def list_adapters(self):
        return list(self.registered)

    def activate_adapter(self, lora_id):
        if lora_id in self._active_adapters:
            return False
        self._active_adapters[lora_id] = None
        return True


class FakeWorkerManager:
    def __init__(self):
        self._adapter_manager = FakeAdapterManager()

    def _load_adapter(self, request):
        self._adapter_manager.registered.append(request.lora_int_id)
        return request

    def add_adapter(self, request):  # the call pattern of LRUCacheWorkerLoRAManager
        if request.lora_int_id not in self._adapter_manager.registered:
            self._load_adapter(request)
        self._adapter_manager.activate_adapter(request.lora_int_id)


def test_tiers_and_events():
    wm = FakeWorkerManager()
    tracker = ResidencyTracker(wm)
    wm.add_adapter(SimpleNamespace(lora_int_id=1))
    wm.add_adapter(SimpleNamespace(lora_int_id=1))  # already resident: no event
    wm._load_adapter(SimpleNamespace(lora_int_id=2))  # host only
    wm._adapter_manager.activate_adapter(99)  # a warm-up dummy: not reported
    report = tracker.snapshot()
    assert report.gpu == (1, 99) and report.host == (2,)
    assert [(e.lora_id, e.tier) for e in report.events] == [(1, "host"), (1, "gpu"), (2, "host")]
    assert all(e.seconds >= 0 for e in report.events)
    assert report.pool is None and report.pages is None  # vLLM's slots: no pool
    assert tracker.snapshot().events == ()  # drained


def test_event_buffer_is_bounded(monkeypatch):
    monkeypatch.setattr(residency, "MAX_BUFFERED_EVENTS", 3)
    wm = FakeWorkerManager()
    tracker = ResidencyTracker(wm)
    for i in range(5):
        wm._load_adapter(SimpleNamespace(lora_int_id=i))
    report = tracker.snapshot()
    assert len(report.events) == 3 and report.dropped_events == 2
    assert [e.lora_id for e in report.events] == [2, 3, 4]
