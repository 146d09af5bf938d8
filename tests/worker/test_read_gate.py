"""The read gate (--loraserve-read-pause forward): while two or more reads
are under way, they park at their checkpoints while the engine thread
launches a forward pass; a lone read never parks."""

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

PASS_S = 10  # how long a checkpoint that should pass may take: it returns at once if it does


def _parked(gate: ReadGate, seconds: float = 0.3) -> tuple[bool, threading.Thread,
                                                          threading.Event]:
    """Whether a thread calling gate.pause() is still waiting `seconds` after
    it reached the call (the thread, and the event it sets once past it)."""
    at, done = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (at.set(), gate.pause(), done.set()))
    t.start()
    assert at.wait(PASS_S)
    parked = not done.wait(seconds)
    return parked, t, done


def test_pause_waits_only_while_the_gate_is_closed_and_reads_overlap():
    gate = ReadGate()
    with gate.reading(), gate.reading():  # two reads under way
        gate.pause()  # open: returns at once
        with gate.closed():
            parked, t, done = _parked(gate)
            assert parked
        assert done.wait(PASS_S)  # opened: the parked thread goes on
        t.join()
        assert gate.paused_s >= 0.15
        parked, t, _ = _parked(gate, PASS_S)
        assert not parked
        t.join()


def test_a_checkpoint_on_the_thread_that_closed_the_gate_raises():
    """The engine thread never reads under its closed gate: a read's part
    threads could park there, and the engine thread would wait for them."""
    gate = ReadGate()
    with gate.closed(), pytest.raises(RuntimeError, match="could deadlock"):
        gate.pause()


@pytest.mark.parametrize("reads", [0, 1])
def test_a_lone_read_passes_a_closed_gate(reads):
    gate = ReadGate()
    with contextlib.ExitStack() as stack:
        for _ in range(reads):
            stack.enter_context(gate.reading())
        with gate.closed():
            parked, t, _ = _parked(gate, PASS_S)
            assert not parked
            t.join()
    assert gate.paused_s == 0


def test_the_read_left_alone_goes_on_under_a_closed_gate():
    """When the other read ends, a parked one runs on before the gate opens."""
    gate = ReadGate()
    with gate.reading(), gate.closed():
        other = gate.reading()
        other.__enter__()
        parked, t, done = _parked(gate)
        assert parked
        other.__exit__(None, None, None)
        assert done.wait(PASS_S)
        t.join()


def test_a_failed_read_stops_counting():
    gate = ReadGate()
    with gate.reading():
        with pytest.raises(OSError), gate.reading():
            raise OSError("a failed read")
        with gate.closed():
            assert not _parked(gate, PASS_S)[0]


def test_the_gate_opens_when_the_forward_pass_raises():
    gate = ReadGate()
    with gate.reading(), gate.reading():
        with pytest.raises(RuntimeError), gate.closed():
            raise RuntimeError("a failed forward pass")
        parked, t, _ = _parked(gate, PASS_S)
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


@pytest.mark.parametrize("parts", [None, 2])
@pytest.mark.parametrize("alone", [False, True])
def test_a_read_under_a_closed_gate_waits_unless_alone_then_reads_the_same_bytes(adapter,
                                                                                alone, parts):
    """With `parts`, the read's pieces and their checkpoints run on part
    threads, which did not enter `reading` themselves."""
    gate = ReadGate()
    want = read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8), 1e30)[1]
    with ThreadPoolExecutor(1) as pool, \
            ThreadPoolExecutor(parts) if parts else contextlib.nullcontext() as executor:
        def read():
            with gate.reading():
                return read_weights(adapter, lambda n: torch.empty(n, dtype=torch.uint8),
                                    1e30, parts=executor, part_bytes=1024, pause=gate.pause)

        with gate.reading() if not alone else contextlib.nullcontext():  # another read
            with gate.closed():
                future = pool.submit(read)
                if alone:
                    future.result(timeout=PASS_S)
                else:
                    time.sleep(0.3)
                    assert not future.done()
            _, raw = future.result(timeout=PASS_S)
    assert torch.equal(raw.data, want.data)
    assert (gate.paused_s > 0) != alone


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
    """_read_file hands read_weights the gate's checkpoint (none without a
    gate), and counts its read for the gate while it runs."""
    from types import SimpleNamespace

    from vllm_loraserve.worker import paged_manager

    got, checkpoints = [], []

    class Gate(ReadGate):
        def pause(self):
            checkpoints.append(self._reads)

    def read_weights(*args, pause=None, **kwargs):
        gate = manager.read_gate
        got.append((pause, gate._reads if gate else None))
        return None, SimpleNamespace(modules={})

    monkeypatch.setattr(paged_manager, "read_weights", read_weights)
    manager = paged_manager.PagedWorkerLoRAManager.__new__(
        paged_manager.PagedWorkerLoRAManager)
    manager.lora_config = SimpleNamespace(lora_dtype=torch.float32)
    manager._read_parts = manager._files = None
    request = SimpleNamespace(lora_path="/nowhere", lora_name="a")
    gates = [Gate(), None]
    for gate in gates:
        manager.read_gate = gate
        with pytest.raises(AttributeError, match="pool"):  # past the read: the layout checks
            manager._read_file(request, lambda n: None)
    assert got == [(gates[0].pause, 1), (None, None)]
    assert checkpoints == [1]  # the read's last checkpoint, still counted
    assert gates[0]._reads == 0  # the read no longer counts after it


class Manager:
    """What _run_step asks of the pool's manager, with a gate: it records
    whether a reader could pass the gate during apply_step and forward."""

    def __init__(self):
        self.read_gate = ReadGate()
        self.step_trace, self.seen, self.ended, self.threads = None, {}, [], []

    def _probe(self, when, seconds):
        parked, t, _ = _parked(self.read_gate, seconds)
        self.seen[when] = parked
        return t

    def apply_step(self, step, idle=False):
        self.threads.append(self._probe("apply", PASS_S))

    def end_forward(self):
        self.ended.append(self.read_gate._closed_by is None)

    def report(self):
        return None


class SchedulerOutput:
    total_num_scheduled_tokens = 8

    def __init__(self):
        setattr(self, STEP_ATTR, None)


@pytest.mark.parametrize("reads", [1, 2])
def test_reads_park_during_the_forward_pass_only_if_two_are_under_way(reads):
    manager = Manager()
    with contextlib.ExitStack() as stack:
        for _ in range(reads):
            stack.enter_context(manager.read_gate.reading())
        window = 0.3 if reads > 1 else PASS_S  # parks, or passes at once
        hooks._run_step(manager, SchedulerOutput(),
                        lambda: manager.threads.append(manager._probe("forward", window)))
    for t in manager.threads:
        t.join(PASS_S)
        assert not t.is_alive()  # it went on once the step ended
    assert manager.seen == {"apply": False, "forward": reads > 1}
    assert manager.ended == [True]  # open again before the forward pass's end


@pytest.mark.parametrize("min_reads,reads,parks", [(2, 2, True), (3, 2, False), (3, 3, True),
                                                    (4, 3, False), (4, 5, True)])
def test_reads_park_from_min_reads_under_way(min_reads, reads, parks):
    gate = ReadGate(min_reads)
    with contextlib.ExitStack() as stack:
        for _ in range(reads):
            stack.enter_context(gate.reading())
        with gate.closed():
            parked, t, done = _parked(gate, 0.3 if parks else PASS_S)
            assert parked == parks
        assert done.wait(PASS_S)
        t.join()


def test_the_configs_gate():
    """--loraserve-read-pause-reads reaches the gate; 'off' builds none; a
    gate that parks lone reads is refused by the config and the gate."""
    from vllm_loraserve.config import LoraServeConfig
    from vllm_loraserve.worker.read_gate import read_gate_for

    cfg = LoraServeConfig(read_pause_reads=3)
    gate = read_gate_for(cfg.read_pause, cfg.read_pause_reads)
    with gate.reading(), gate.reading(), gate.closed():
        assert not _parked(gate, PASS_S)[0]  # two of three
    assert read_gate_for("off", 3) is None
    with pytest.raises(ValueError, match="read_pause_reads must be an integer >= 2"):
        LoraServeConfig(read_pause_reads=1)
    with pytest.raises(ValueError, match="at most read_threads .4.: no more reads run"):
        LoraServeConfig(read_pause_reads=5)
    assert LoraServeConfig(read_pause_reads=5, read_threads=5).read_pause_reads == 5
    assert LoraServeConfig(read_pause_reads=5, read_pause="off").read_pause == "off"
    assert LoraServeConfig(read_threads=1).read_pause_reads == 2  # the default still starts
    with pytest.raises(ValueError, match="at least 2"):
        ReadGate(1)
