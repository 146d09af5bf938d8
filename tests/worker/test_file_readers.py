"""The host tier's reader processes (worker/file_readers.py): adapters read
and screened in processes of their own, into the tier's shared chunks."""

from __future__ import annotations

import errno
import os
import signal
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
            assert "reader process died" in str(e)
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
