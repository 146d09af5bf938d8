"""The host tier's reader processes (worker/file_readers.py): adapters read
and screened in processes of their own, into the tier's shared chunks."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm_loraserve.adapters import peft
from vllm_loraserve.worker.arena import PinnedArena
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks
from vllm_loraserve.worker.file_readers import ReaderProcesses
from vllm_loraserve.worker.host_tier import is_transient

FP16_MAX = torch.finfo(torch.float16).max
MODULES = [f"model.layers.{i}.self_attn.{m}" for i in range(3) for m in ("q_proj", "v_proj")]


def _adapter(path, bad=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {m: (torch.randn(8, 96, generator=g).bfloat16(), torch.randn(96, 8, generator=g).bfloat16())
         for m in MODULES}
    if bad is not None:
        w[MODULES[3]][1][5, 2] = bad
    peft.write_adapter(str(path), w, rank=8, alpha=16.0, base_model="x")
    return str(path)


@pytest.fixture
def tier():
    """An arena of shared chunks, 2 reader processes mapping them, 2 part threads."""
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena(1 << 20, 2, pinned=False, make_chunk=chunks)
    files = ReaderProcesses(chunks.segments, 2)
    parts = ThreadPoolExecutor(2)
    yield arena, files, parts
    parts.shutdown()
    files.close()
    chunks.close()


def _read(arena, files, parts, path):
    return peft.read_weights(path, lambda n: arena.view(arena.alloc(n), n), FP16_MAX,
                             parts=parts, part_bytes=4096, files=files)


def test_the_processes_read_and_screen_what_this_process_would(tier, tmp_path, monkeypatch):
    """The same bytes as a read in this process, though this process reads
    no byte of the file's data (its positional reads would fail); a file
    with NaN fails with the tensor's name, as it does here."""
    arena, files, parts = tier
    ok, nan = _adapter(tmp_path / "ok"), _adapter(tmp_path / "nan", bad=float("nan"))
    here = peft.read_weights(ok, lambda n: torch.empty(n, dtype=torch.uint8), FP16_MAX)[1]
    monkeypatch.setattr(peft, "_pread_into", lambda *a: pytest.fail("read in the engine"))
    spec, raw = _read(arena, files, parts, ok)
    assert raw.data.numel() > 4 * 4096 and torch.equal(raw.data, here.data)
    assert raw.modules == here.modules and spec.rank == 8
    with pytest.raises(peft.BadWeights, match=f"tensor lora_B of {MODULES[3]} holds non-finite"):
        _read(arena, files, parts, nan)


def test_a_reader_that_dies_fails_its_read_as_transient_and_is_replaced(tier, tmp_path):
    arena, files, parts = tier
    path = _adapter(tmp_path / "a")
    before = files.pids
    os.kill(before[0], signal.SIGKILL)
    os.waitpid(before[0], 0)
    failures = 0
    for _ in range(3):  # the dead one is taken by one of them
        try:
            _read(arena, files, parts, path)
        except peft.AdapterError as e:
            failures += 1
            assert is_transient(e) and e.__cause__.errno == errno.EIO
            assert "host-tier reader process" in str(e)
    assert failures == 1 and files.respawns == 1
    assert len(files.pids) == 2 and before[0] not in files.pids
    _read(arena, files, parts, path)


def test_a_file_removed_fails_as_it_does_in_this_process(tier, tmp_path):
    """A file that goes after its header was read: the process's errno
    reaches the tier (ENOENT, not transient), as this process's read would."""
    arena, files, parts = tier
    path = _adapter(tmp_path / "a")
    real = peft._safetensors_index

    def then_removed(st_path, where):
        index = real(st_path, where)
        os.remove(st_path)
        return index

    errors = []
    for reader in (files, None):
        _adapter(tmp_path / "a")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(peft, "_safetensors_index", then_removed)
            with pytest.raises(peft.AdapterError, match="unreadable") as e:
                peft.read_weights(path, lambda n: arena.view(arena.alloc(n), n), FP16_MAX,
                                  parts=parts, part_bytes=4096, files=reader)
        errors.append(e.value)
    assert [x.__cause__.errno for x in errors] == [errno.ENOENT] * 2
    assert [is_transient(x) for x in errors] == [False, False]
    assert str(errors[0]) == str(errors[1])  # the same message, the file named once


def test_memory_outside_the_chunks_is_refused(tier):
    _, files, _ = tier
    with pytest.raises(ValueError, match="only into the host tier's chunks"):
        files.read_spans("/dev/null", 0, torch.empty(64, dtype=torch.uint8), [(0, 64)], None)


def test_close_stops_the_processes(tmp_path):
    chunks = SharedChunks(pinned=False)
    PinnedArena(1 << 16, 1, pinned=False, make_chunk=chunks)
    files = ReaderProcesses(chunks.segments, 2)
    pids = files.pids
    files.close()
    files.close()
    assert files.pids == []
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    chunks.close()


def test_many_threads_share_the_processes_and_every_read_ends(tier, tmp_path):
    """More readers than processes (the tier's 4 readers and the engine
    thread share them): every read ends, each with its file's bytes."""
    arena, files, _ = tier
    paths = [_adapter(tmp_path / f"a{i}", seed=i) for i in range(3)]
    want = [peft.read_weights(p, lambda n: torch.empty(n, dtype=torch.uint8))[1].data
            for p in paths]
    lock = threading.Lock()
    done = []

    def reader(i):
        for j in range(20):
            with lock:
                extent = arena.alloc(want[0].numel())
            try:
                k = (i + j) % len(paths)
                raw = peft.read_weights(paths[k], lambda n, e=extent: arena.view(e, n), FP16_MAX,
                                        part_bytes=2048, files=files)[1]
                assert torch.equal(raw.data, want[k])
            finally:
                with lock:
                    arena.free(extent)
            done.append(1)

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and len(done) == 100


def test_a_reader_that_hangs_is_replaced_and_its_read_fails_as_transient(tmp_path):
    """A process that stops answering (stopped here) fails its read once its
    time is up, as an I/O error, and a new process serves the next read."""
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena(1 << 20, 1, pinned=False, make_chunk=chunks)
    files = ReaderProcesses(chunks.segments, 1, timeout_s=1.0)
    path = _adapter(tmp_path / "a")
    try:
        os.kill(files.pids[0], signal.SIGSTOP)
        with pytest.raises(peft.AdapterError, match="did not read .* within 1 s") as e:
            _read(arena, files, None, path)
        assert is_transient(e.value) and files.respawns == 1
        files._timeout_s = 60.0  # the new process's read: no luck needed on a loaded machine
        assert _read(arena, files, None, path)[0].rank == 8
    finally:
        files.close()
        chunks.close()


def test_an_interrupted_wait_never_leaves_an_answer_for_the_next_read(tier, tmp_path,
                                                                       monkeypatch):
    """The thread waiting for an answer is interrupted (vLLM's signal
    handlers raise on the engine thread): its process is replaced, so the
    next read gets its own answer, not the old one."""
    arena, files, parts = tier
    path = _adapter(tmp_path / "a")
    answer = files._answer

    def interrupted(*args):
        monkeypatch.setattr(files, "_answer", answer)
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "_answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _read(arena, files, parts, path)
    assert files.respawns == 1 and len(files.pids) == 2
    dest = arena.view(arena.alloc(64), 64)
    for _ in range(2):  # both processes: each answers its own request
        with pytest.raises(FileNotFoundError):
            files.read_spans(str(tmp_path / "missing"), 0, dest, [(0, 64)], None)


def test_an_error_in_a_reader_is_that_read_s_alone(tier, tmp_path):
    """A read the process cannot do (a piece whose bytes are not whole
    values) fails with its reason; the process goes on serving."""
    arena, files, parts = tier
    path = _adapter(tmp_path / "a")
    dest = arena.view(arena.alloc(64), 64)
    with pytest.raises(RuntimeError, match="failed reading .*ValueError"):
        files.read_spans(os.path.join(path, peft.SAFETENSORS_FILE), 0, dest, [(0, 3)], "BF16")
    assert files.respawns == 0
    assert _read(arena, files, parts, path)[0].rank == 8


def test_readers_that_cannot_be_replaced_fail_reads_as_transient(tmp_path, monkeypatch):
    """A reader that dies and cannot be replaced (no interpreter to start)
    fails its read as an I/O error; once none is left, every read does,
    at once, and none of those failures sticks to an adapter."""
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena(1 << 20, 1, pinned=False, make_chunk=chunks)
    files = ReaderProcesses(chunks.segments, 1)
    path = _adapter(tmp_path / "a")
    try:
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
        os.kill(files.pids[0], signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(peft.AdapterError) as e:
                _read(arena, files, None, path)
            assert is_transient(e.value), e.value
        assert "no host-tier reader process is left" in str(e.value) and files.pids == []
    finally:
        files.close()
        chunks.close()
