"""The read gate (--loraserve-read-pause): reads park at their checkpoints
while the engine thread launches a forward pass (`forward`) or runs its
whole step (`step`), and never while it waits for a read."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm_loraserve.adapters.peft import read_weights, write_adapter
from vllm_loraserve.paging.step import STEP_ATTR
from vllm_loraserve.worker import hooks
from vllm_loraserve.worker.read_gate import ReadGate


def _parked(gate: ReadGate, seconds: float = 0.3) -> tuple[bool, threading.Thread,
                                                          threading.Event]:
    """Whether a thread calling gate.pause() is still waiting after `seconds`
    (the thread, and the event it sets once past it)."""
    done = threading.Event()
    t = threading.Thread(target=lambda: (gate.pause(), done.set()))
    t.start()
    parked = not done.wait(seconds)
    return parked, t, done


def test_pause_waits_only_while_another_thread_holds_it_closed():
    gate = ReadGate()
    gate.pause()  # open: returns at once
    with gate.closed():
        gate.pause()  # the thread that closed it passes (it never waits for itself)
        parked, t, done = _parked(gate)
        assert parked
    assert done.wait(2)  # opened: the parked thread goes on
    t.join()
    assert gate.paused_s >= 0.15
    parked, t, _ = _parked(gate, 0.5)
    assert not parked
    t.join()


def test_the_closing_thread_opens_it_while_it_waits_for_a_read():
    gate = ReadGate()
    with gate.opened():  # open already: nothing changes
        assert not _parked(gate, 2)[0]
    with gate.closed():
        with gate.opened():
            with gate.opened():  # nested: the outer one still holds it open
                pass
            parked, t, _ = _parked(gate, 2)
            assert not parked
            t.join()
        parked, t, done = _parked(gate)  # closed again
        assert parked
        opener = threading.Thread(target=lambda: gate.opened().__enter__())
        opener.start()  # another thread cannot open it
        opener.join()
        assert not done.wait(0.2)
    assert done.wait(2)
    t.join()


def test_the_gate_opens_when_the_forward_pass_raises():
    gate = ReadGate()
    with pytest.raises(RuntimeError), gate.closed():
        raise RuntimeError("a failed forward pass")
    parked, t, _ = _parked(gate, 0.5)
    assert not parked
    t.join()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gate") / "a")
    g = torch.Generator().manual_seed(0)
    write_adapter(path, {f"model.layers.{i}.self_attn.q_proj": (
        torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)) for i in range(4)},
        rank=4, alpha=8, base_model="x")
    return path


@pytest.mark.parametrize("parts", [None, 2])
def test_a_read_checks_the_gate_before_its_metadata_and_each_piece(adapter, parts):
    calls = []
    with ThreadPoolExecutor(parts) if parts else contextlib.nullcontext() as executor:
        spec, raw = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30,
                                 parts=executor, part_bytes=1024,
                                 pause=lambda: calls.append(threading.get_ident()))
    size = raw.data.numel()
    assert size > 4 * 1024
    pieces = -(-size // 1024) if parts else 1  # without parts threads, one piece
    assert len(calls) == 1 + pieces


def test_a_read_under_a_closed_gate_waits_then_reads_the_same_bytes(adapter):
    gate = ReadGate()
    want = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30)[1]
    with ThreadPoolExecutor(1) as pool:
        with gate.closed():
            future = pool.submit(read_weights, adapter,
                                 lambda n: torch.empty(n, dtype=torch.uint8), 1e30,
                                 pause=gate.pause)
            time.sleep(0.2)
            assert not future.done()
        _, raw = future.result(timeout=10)
    assert torch.equal(raw.data, want.data)
    assert gate.paused_s > 0.05


def test_a_read_in_a_reader_process_checks_the_gate_before_and_after_it(adapter):
    """With reader processes (`files`), the pieces are read there: the read's
    checkpoints are before its metadata work and after the process's answer."""
    from vllm_loraserve.adapters.peft import read_file_spans

    events = []

    class Files:  # reads in this process, as a reader process would
        def read_spans(self, path, start, dest, spans, screen):
            events.append("answer")
            return read_file_spans(path, start, memoryview(dest.numpy()), spans, screen, None)

    want = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30)[1]
    _, raw = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30,
                          files=Files(), part_bytes=1024, pause=lambda: events.append("pause"))
    assert events == ["pause", "answer", "pause"]
    assert torch.equal(raw.data, want.data)


def test_each_piece_waits_at_its_checkpoint_before_it_is_read(adapter, monkeypatch):
    """The checkpoint comes before each piece's read, not after it."""
    import os

    from vllm_loraserve.adapters import peft

    reads, seen = [], []
    real = peft._pread_into
    monkeypatch.setattr(peft, "_pread_into", lambda *a: (reads.append(1), real(*a))[1])
    path = os.path.join(adapter, "adapter_model.safetensors")
    view = memoryview(bytearray(4096))
    peft.read_file_spans(path, 0, view, [(0, 1024), (1024, 2048), (2048, 4096)], None, None,
                         lambda: seen.append(len(reads)))
    assert seen == [0, 1, 2] and len(reads) == 3


def test_the_managers_reads_pass_its_gate(monkeypatch):
    """_read_file hands read_weights the gate's checkpoint (none without a gate)."""
    from types import SimpleNamespace

    from vllm_loraserve.worker import paged_manager

    got = []

    def read_weights(*args, pause=None, **kwargs):
        got.append(pause)
        raise RuntimeError("stop here")

    monkeypatch.setattr(paged_manager, "read_weights", read_weights)
    manager = paged_manager.PagedWorkerLoRAManager.__new__(
        paged_manager.PagedWorkerLoRAManager)
    manager.lora_config = SimpleNamespace(lora_dtype=torch.float32)
    manager._read_parts = manager._files = None
    request = SimpleNamespace(lora_path="/nowhere", lora_name="a")
    gates = [ReadGate(), None]
    for gate in gates:
        manager.read_gate = gate
        with pytest.raises(RuntimeError, match="stop here"):
            manager._read_file(request, lambda n: None)
    assert got == [gates[0].pause, None]


class Manager:
    """What _run_step asks of the pool's manager, with a gate: it records
    whether a reader could pass the gate during apply_step (outside and
    inside a wait for a read, as the host tier opens the gate) and forward."""

    def __init__(self, read_pause):
        self.read_gate, self.read_pause = ReadGate(), read_pause
        self.step_trace, self.seen, self.ended, self.threads = None, {}, [], []

    def _probe(self, when, seconds):
        parked, t, _ = _parked(self.read_gate, seconds)
        self.seen[when] = parked
        return t

    def apply_step(self, step, idle=False):
        with self.read_gate.opened():  # a read a step waits for must not park here
            t = self._probe("waiting", 2)
            t.join(2)
            assert not t.is_alive()
        self.threads.append(self._probe("apply", 1))

    def end_forward(self):
        self.ended.append(self.read_gate._open.is_set())

    def report(self):
        return None


class SchedulerOutput:
    total_num_scheduled_tokens = 8

    def __init__(self):
        setattr(self, STEP_ATTR, None)


@pytest.mark.parametrize("read_pause", ["forward", "step"])
def test_reads_park_during_the_forward_pass_or_the_whole_step(read_pause):
    manager = Manager(read_pause)
    hooks._run_step(manager, SchedulerOutput(),
                    lambda: manager.threads.append(manager._probe("forward", 0.3)))
    for t in manager.threads:
        t.join(2)
        assert not t.is_alive()  # it went on once the step ended
    assert manager.seen == {"waiting": False, "apply": read_pause == "step", "forward": True}
    assert manager.ended == [True]  # open again before the forward pass's end


def test_the_engine_threads_reads_and_waits_pass_a_gate_it_closed(adapter):
    """Under a gate closed by the engine thread (`step`), the host tier's
    `get` reads an adapter there (its pieces on part threads, which pass the
    gate's checkpoints) and waits for a background read parked at the gate:
    both end, because the tier opens the gate while it waits (`waiting`)."""
    from vllm_loraserve.worker.arena import PinnedArena
    from vllm_loraserve.worker.host_tier import HostTier

    class Req:
        def __init__(self, i):
            self.lora_int_id, self.lora_name = i, f"a{i}"

    gate, got, at_gate = ReadGate(), {}, threading.Event()
    want = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30)[1]
    with ThreadPoolExecutor(2) as parts:
        def checkpoint():
            at_gate.set()
            gate.pause()

        def read(req, alloc):
            return read_weights(adapter, alloc, 1e30, parts=parts, part_bytes=1024,
                                pause=checkpoint)[1]

        tier = HostTier(PinnedArena(1 << 20, 1, pinned=False), read, threads=1,
                        waiting=gate.opened)

        def engine():
            with gate.closed():
                got[1] = tier.get(Req(1))  # read on this thread
                at_gate.clear()
                assert tier.prefetch(Req(2), 1 << 14)
                assert at_gate.wait(10)  # the background read is at its first checkpoint
                time.sleep(0.2)  # and parked there
                got[2] = tier.get(Req(2))  # waits for it

        t = threading.Thread(target=engine)
        t.start()
        t.join(20)
        hung = t.is_alive()
        gate._open.set()  # a hung step's reads go on, so that the test ends
        t.join(20)
        assert not hung
    assert [hit for _, hit in (got[1], got[2])] == [False, False]
    for raw, _ in got.values():
        assert torch.equal(raw.data, want.data)
    assert gate.paused_s > 0  # the background read did park
    tier.shutdown()
