"""The pool's host tier with a fake reader: LRU order within the arena,
entries kept for waiting requests, fresh reads, failures (sticky or
transient), generations, and an evicted entry's memory held until the
engine's copies from it are done."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vllm_loraserve.adapters.peft import AdapterError, BadWeights
from vllm_loraserve.paging.step import TRANSIENT_NOTE, PoolReport
from vllm_loraserve.worker.arena import ALIGN, PinnedArena
from vllm_loraserve.worker.host_tier import HostTier, StepOverflow, is_transient


@dataclass
class Req:
    lora_int_id: int
    nbytes: int = ALIGN
    error: Exception | None = None
    gate: threading.Event | None = None  # the read waits for it, after its alloc

    @property
    def lora_name(self) -> str:
        return f"a{self.lora_int_id}"


def fake_read(req: Req, alloc) -> torch.Tensor:
    """The adapter's 'file' is `nbytes` bytes of its id."""
    buf = alloc(req.nbytes)
    if req.gate is not None:
        assert req.gate.wait(60)
    if req.error is not None:
        raise req.error
    buf.fill_(req.lora_int_id)
    return buf


class FakeFence:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def tier(pages: int, chunks: int = 1, fences: list | None = None) -> HostTier:
    fence = (lambda: fences.append(FakeFence()) or fences[-1]) if fences is not None else None
    return HostTier(PinnedArena(pages * ALIGN, chunks, pinned=False), fake_read, threads=2,
                    **({"fence": fence} if fence else {}))


def step(t: HostTier, *ids: int) -> list[bool]:
    """One engine step loading `ids`; whether each was a hit. Entries hold
    their own id (no extent was shared or overwritten)."""
    hits = []
    for i in ids:
        buf, hit = t.get(Req(i))
        assert bool((buf == i).all()), f"entry {i} was overwritten"
        hits.append(hit)
    t.end_step()
    t.report()
    t.check()
    return hits


def settle(t: HostTier, limit: float = 60.0) -> None:
    """Until no background read is under way (a loaded CI machine can take
    seconds), then the tier's invariants."""
    deadline = time.monotonic() + limit
    while t.wait_for_a_read(0.05):
        assert time.monotonic() < deadline, "a background read did not finish"
    t.check()


def test_lru_within_the_arena():
    t = tier(pages=4)
    assert step(t, 0, 1, 2, 3) == [False] * 4
    assert step(t, 0) == [True]  # 1 is now the least recently used
    assert step(t, 4) == [False]
    assert sorted(t.ids()) == [0, 2, 3, 4] and t.bytes_used == 4 * ALIGN == t.budget
    t.get(Req(5, nbytes=2 * ALIGN))  # two pages: 2 and 3 go
    t.end_step()
    assert sorted(t.ids()) == [0, 4, 5]
    t.check()


def test_an_extent_never_spans_chunks():
    t = tier(pages=2, chunks=2)
    step(t, 0, 1)
    assert step(t, 0) == [True]  # 1 is the LRU entry; 0 and 1 are in one chunk
    t.get(Req(2, nbytes=2 * ALIGN))  # a chunk of its own: the other one is empty
    t.end_step()
    assert sorted(t.ids()) == [0, 1, 2]
    t.get(Req(3, nbytes=2 * ALIGN))  # no room without a whole chunk: 1 and 0 go
    t.end_step()
    assert sorted(t.ids()) == [2, 3]
    t.check()


def test_kept_entries_go_last():
    t = tier(pages=3)
    step(t, 0, 1, 2)
    # 0 and 1 are older, but waiting requests still need 0: 1 and 2 go first.
    t.set_keep({0})
    t.get(Req(3, nbytes=2 * ALIGN))
    t.end_step()
    assert sorted(t.ids()) == [0, 3]
    # Only kept entries left to evict: a step's own read evicts them too.
    t.set_keep({0, 3})
    t.get(Req(4, nbytes=3 * ALIGN))
    t.end_step()
    assert t.ids() == [4] and t.bytes_used == 3 * ALIGN
    t.check()


def test_read_ahead_needs_room_beside_kept_entries_and_reads_under_way():
    t = tier(pages=3)
    step(t, 0, 1)
    t.set_keep({0})
    assert t.has_room(2 * ALIGN)  # 1 can make room
    t.set_keep({0, 1})
    assert not t.has_room(2 * ALIGN)
    assert not t.prefetch(Req(2), 2 * ALIGN)
    gate = threading.Event()
    assert t.prefetch(Req(2, gate=gate), ALIGN)  # the last free page
    assert not t.prefetch(Req(3), ALIGN)  # reserved by the read under way
    gate.set()
    settle(t)
    assert sorted(t.ids()) == [0, 1, 2]
    # An empty tier with nothing under way admits any read.
    assert tier(pages=1).has_room(5 * ALIGN)


def test_waiting_for_a_read_is_not_ended_by_a_finished_one():
    """A finished read whose done callback has not run yet (its thread waits
    for the GIL) must not end the wait for one still under way at once: CI
    once saw a test take its reads as settled while one was still reading."""
    from concurrent.futures import Future

    t = tier(pages=3)
    gate = threading.Event()
    assert t.prefetch(Req(1, gate=gate), ALIGN)
    finished: Future = Future()
    finished.set_result(None)
    t._reading[9] = finished, 0  # the finished read, its callback still to come
    start = time.monotonic()
    assert t.wait_for_a_read(0.2) is True  # read 1 is still under way
    assert time.monotonic() - start >= 0.2
    gate.set()
    settle(t)
    assert not t.wait_for_a_read(0.2) and t.ids() == [1]


def test_a_finished_read_whose_callback_is_late_reserves_nothing(monkeypatch):
    """Every done callback 0.3 s late (its reader thread descheduled): once a
    read's future is done, its adapter is in the tier for `state`, its room
    is free for `has_room`, and a read of another adapter starts."""
    from concurrent.futures import _base

    invoke = _base.Future._invoke_callbacks

    def late(self):
        time.sleep(0.3)
        invoke(self)

    monkeypatch.setattr(_base.Future, "_invoke_callbacks", late)
    t = tier(pages=2)
    assert t.prefetch(Req(1, nbytes=2 * ALIGN), 2 * ALIGN)
    deadline = time.monotonic() + 30
    while t.state(1) != ("host", None):
        assert time.monotonic() < deadline, t.state(1)
        time.sleep(0.01)
    assert t.report().host_ready == {1}  # 1 is no longer fresh: it may be evicted
    assert t.has_room(2 * ALIGN)  # and nothing is reserved
    assert not t.prefetch(Req(1), ALIGN)  # in the tier: not read again
    assert t.prefetch(Req(2, nbytes=2 * ALIGN), 2 * ALIGN)
    settle(t)
    assert t.ids() == [2]


def test_a_background_read_gives_up_rather_than_evict_kept_entries():
    """Its estimate was too small: it evicts what it may, finds no room
    beside the kept entry and gives up, with no failure; the step that
    needs it reads it, evicting the kept entry."""
    t = tier(pages=2)
    step(t, 0, 1)
    t.set_keep({0})
    assert t.prefetch(Req(2, nbytes=2 * ALIGN), ALIGN)
    settle(t)
    assert t.ids() == [0]  # 1 went, 2 did not fit beside 0
    report = t.report()
    assert report.host_ready == {0} and not report.failed
    assert t.get(Req(2, nbytes=2 * ALIGN))[1] is False
    t.end_step()
    assert t.ids() == [2]
    t.check()


def test_fresh_reads_are_reported_once_even_if_evicted():
    t = tier(pages=1)
    assert t.prefetch(Req(0), ALIGN)
    settle(t)
    t.get(Req(1))  # the step needs 1: the fresh 0 goes
    t.end_step()
    assert t.ids() == [1]
    assert t.report().host_ready == {0, 1}
    assert t.report().host_ready == {1}


def test_a_failed_read_is_recorded_and_its_extent_freed():
    t = tier(pages=2)
    bad = Req(7, error=OSError("disk gone"))
    assert t.prefetch(bad, ALIGN)
    settle(t)
    assert "OSError: disk gone" in t.report().failed[7]
    assert t.arena.used == 0 and 7 not in t
    assert not t.prefetch(Req(7), ALIGN)  # failed: not read again
    with pytest.raises(OSError):
        t.get(bad)
    # A runtime add starts over: its own failure is its error, not recorded.
    with pytest.raises(OSError):
        t.add(bad)
    assert t.failed_ids() == set()
    t.add(Req(7))
    assert 7 in t and t.arena.used == ALIGN
    t.check()


def test_a_too_large_adapter_fails_alone():
    t = tier(pages=2)
    step(t, 0)
    with pytest.raises(Exception, match="more than the host tier's largest buffer"):
        t.get(Req(1, nbytes=3 * ALIGN))
    assert "largest buffer" in t.report().failed[1]
    assert t.ids() == [0]
    t.check()


def test_a_read_overtaken_by_a_runtime_remove_commits_nothing():
    t = tier(pages=2)
    gate = threading.Event()
    assert t.prefetch(Req(0, gate=gate), ALIGN)
    deadline = time.monotonic() + 30
    while not t.arena.used:  # the read holds its extent
        assert time.monotonic() < deadline, "the read did not allocate"
        time.sleep(0.01)
    assert t.arena.used == ALIGN
    assert not t.remove(0)
    gate.set()
    t.shutdown()  # waits for the read
    assert t.ids() == [] and t.arena.used == 0


def test_an_entry_in_use_keeps_its_memory_until_its_copies_are_done():
    """The engine thread took 0 for a copy that has not run yet (its
    fence is not done); a reader evicting 0 must not reuse its bytes."""
    fences: list[FakeFence] = []
    t = tier(pages=1, fences=fences)
    buf, _ = t.get(Req(0))
    t.end_step()
    t.report()
    assert len(fences) == 1 and not fences[0].done
    assert t.prefetch(Req(1), ALIGN)
    settle(t)
    assert t.ids() == [] and t.arena.used == ALIGN  # 0 evicted, its extent held
    assert bool((buf == 0).all())
    fences[0].done = True  # the copy ran
    assert t.prefetch(Req(1), ALIGN)
    settle(t)
    assert t.ids() == [1]
    # The engine thread's own read waits for the copy instead.
    t.get(Req(1))
    t.end_step()
    assert not fences[1].done
    t.get(Req(2))
    assert fences[1].waited and t.ids() == [2]
    t.end_step()
    t.check()


def test_an_entry_used_in_this_step_is_not_overwritten_by_this_step():
    """Without a fence (CPU), a step's later read may reuse an extent only
    after the step's earlier uses are closed (its copies were issued)."""
    t = tier(pages=1)
    buf, _ = t.get(Req(0))
    t.report()
    assert t.prefetch(Req(1), ALIGN)  # a reader may evict 0, not reuse it yet
    settle(t)
    assert bool((buf == 0).all()) and t.ids() == []
    t.end_step()
    assert t.prefetch(Req(1), ALIGN)  # now it may
    settle(t)
    assert t.ids() == [1]


def copy_taken(taken: list[tuple[int, torch.Tensor]]) -> None:
    """The step's copies from the entries it took: each still holds its id."""
    for j, buf in taken:
        assert bool((buf == j).all()), f"entry {j} was overwritten before its copy"
    taken.clear()


def test_random_churn_keeps_the_invariants():
    rng = random.Random(0)
    fences: list[FakeFence] = []
    t = tier(pages=6, chunks=2, fences=fences)
    for _ in range(300):
        held = t.ids()  # once: a prefetch landing on a reader thread changes it
        t.set_keep(rng.sample(held, k=min(len(held), rng.randint(0, 2))))
        for _ in range(rng.randint(0, 2)):
            i = rng.randrange(12)
            t.prefetch(Req(i, nbytes=rng.randint(1, 3) * ALIGN - rng.randrange(ALIGN)), ALIGN)
        ids = rng.sample(range(12), k=rng.randint(0, 3))
        taken: list[tuple[int, torch.Tensor]] = []  # this step's entries, "copied" at its end
        for i in ids:
            if rng.random() < 0.1:
                t.remove(i)
                continue
            req = Req(i, nbytes=rng.randint(1, 6) * ALIGN)
            try:
                buf, _ = t.get(req)
            except StepOverflow:  # as worker/paged_manager.py does
                copy_taken(taken)
                t.end_step()
                buf, _ = t.get(req)
            assert bool((buf == i).all())
            taken.append((i, buf))
        copy_taken(taken)
        t.end_step()
        for f in fences:
            f.done = f.done or rng.random() < 0.5
        t.report()
        t.check()
    settle(t)
    assert t.bytes_used <= t.budget


def test_a_removed_adapter_read_back_goes_once_nothing_needs_it():
    """Issue 22's storm: a request admitted before its adapter's remove
    reads it back; that copy stays while the adapter holds pages or
    waiting requests need it, then goes (it would leak otherwise)."""
    t = tier(pages=4)
    step(t, 0, 1)
    assert t.remove(0) and 0 not in t
    step(t, 0)  # read back for a request admitted before the remove
    t.set_keep({0})
    t.drop_removed(resident=())
    assert 0 in t  # its request still waits
    t.set_keep(())
    t.drop_removed(resident={0})
    assert 0 in t  # it holds pages
    t.drop_removed(resident=())
    assert t.ids() == [1] and t.bytes_used == ALIGN  # 1 was never removed
    t.end_step()
    t.check()


def test_an_id_added_back_after_its_remove_stays():
    t = tier(pages=4)
    step(t, 0)
    assert t.remove(0)
    t.add(Req(0))
    t.report()  # the add's read is reported: no longer kept as fresh
    t.end_step()
    t.drop_removed(resident=())
    assert 0 in t and t.bytes_used == ALIGN
    t.check()


@dataclass
class FileReq:
    lora_int_id: int
    path: str

    @property
    def lora_name(self) -> str:
        return f"a{self.lora_int_id}"


def test_the_values_are_checked_in_the_read_once_on_a_reader(tmp_path, monkeypatch):
    """The pool's read (adapters/peft.py `read_weights` with the serving
    dtype's range, as worker/paged_manager.py `_read_file` calls it): the
    NaN/Inf and overflow check runs on the reader threads (a reader and the
    part threads it splits its read over), over the tier's own buffer, as a
    screen of each piece as it is read, and tensor by tensor only for the
    adapters the screen refuses; each weights file's bytes are read once; a refused adapter
    fails alone with a reason that says what is wrong with it, and the
    others are read and kept."""
    from vllm_loraserve.adapters import peft

    dims = {f"model.layers.{i}.self_attn.q_proj": (64, 64) for i in range(2)}

    def adapter(name, alpha=8.0, bad=None):
        g = torch.Generator().manual_seed(len(name))
        w = {m: (torch.randn(4, i, generator=g), torch.randn(o, 4, generator=g))
             for m, (i, o) in dims.items()}
        if bad is not None:
            w["model.layers.1.self_attn.q_proj"][1][3, 2] = bad
        peft.write_adapter(str(tmp_path / name), w, rank=4, alpha=alpha, base_model="x")
        return str(tmp_path / name)

    # 2: scaling 2e4 is fine in fp16, times its largest |B| (10) it is not
    paths = {0: adapter("ok"), 1: adapter("nan", bad=float("nan")),
             2: adapter("huge", alpha=8e4, bad=10.0), 3: adapter("ok2")}
    fp16_max = torch.finfo(torch.float16).max
    # As paged_manager reads: each file split over threads of its own, in
    # pieces of 2500 bytes here (the files hold 4 KiB in tensors of 1 KiB:
    # two pieces, and three tensors in a check group).
    parts = ThreadPoolExecutor(2, thread_name_prefix="loraserve-read-part")
    t = HostTier(PinnedArena(64 * ALIGN, 1, pinned=False),
                 lambda req, alloc: peft.read_weights(req.path, alloc, fp16_max, parts=parts,
                                                      part_bytes=2500), threads=2)

    bytes_read: dict[str, int] = {}
    real_open = open

    class Counted:  # a weights file: every byte Python reads from it, counted
        def __init__(self, f, path):
            self.f, self.path = f, path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, *a):
            return self.f.seek(*a)

        def fileno(self):
            return self.f.fileno()

        def read(self, n=-1):
            data = self.f.read(n)
            bytes_read[self.path] = bytes_read.get(self.path, 0) + len(data)
            return data

        def readinto(self, buf):
            n = self.f.readinto(buf)
            bytes_read[self.path] = bytes_read.get(self.path, 0) + n
            return n

    def counted_open(path, *a, **kw):
        f = real_open(path, *a, **kw)
        return (Counted(f, os.path.realpath(path)) if str(path).endswith(peft.SAFETENSORS_FILE)
                else f)

    checked = []
    check = peft.check_weight_values

    def in_arena(x):
        return any(c.data_ptr() <= x.data_ptr() < c.data_ptr() + c.numel()
                   for c in t.arena.chunks)

    def recorded(spec, tensors, max_value, *args):
        def seen():
            for name, x, is_b in tensors:
                checked.append((threading.current_thread().name, spec.path, in_arena(x)))
                yield name, x, is_b
        return check(spec, seen(), max_value, *args)

    screened = []  # each piece's screen: (thread, its file, its dtype, in the tier's arena)
    screen_span = peft.read_span

    def recorded_span(fd, view, start, lo, hi, screen):
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        screened.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}"),
                         screen, any(c.data_ptr() <= address < c.data_ptr() + c.numel()
                                     for c in t.arena.chunks)))
        return screen_span(fd, view, start, lo, hi, screen)

    pread = peft._pread_into

    count_lock = threading.Lock()  # part threads count into the same file's entry

    def counted_pread(fd, view, start, lo, hi):  # the data's positional reads
        n = pread(fd, view, start, lo, hi)
        path = os.readlink(f"/proc/self/fd/{fd}")
        with count_lock:
            bytes_read[path] = bytes_read.get(path, 0) + n
        return n

    monkeypatch.setattr(peft, "open", counted_open, raising=False)
    monkeypatch.setattr(peft, "_pread_into", counted_pread)
    monkeypatch.setattr(peft, "read_span", recorded_span)
    monkeypatch.setattr(peft, "check_weight_values", recorded)
    monkeypatch.setattr(peft, "_read_tensors", lambda path: pytest.fail(f"{path} read twice"))
    for i, path in paths.items():
        assert t.prefetch(FileReq(i, path), ALIGN)
    settle(t)

    report = t.report()
    assert report.host_ready == {0, 3} and sorted(t.ids()) == [0, 3]
    assert report.failed[1] == ("tensor lora_B of model.layers.1.self_attn.q_proj holds "
                                "non-finite values (NaN or Inf)")
    assert "largest |lora_B| weight 10 is 2e+05, above 6.55e+04, the largest value of the " \
        "serving dtype" in report.failed[2]
    assert not any("could not be read" in r for r in report.failed.values())
    for i, path in paths.items():  # each file's bytes once: its header, then its data
        st = os.path.realpath(os.path.join(path, peft.SAFETENSORS_FILE))
        assert bytes_read[st] == os.path.getsize(st), (i, bytes_read)
    # Every file screened as read, on the readers, in the tier's memory;
    # tensor by tensor only the two the screen refused (to say why).
    assert screened and all(name.startswith("loraserve-read") and screen == "F32" and in_tier
                            for name, _, screen, in_tier in screened), screened
    assert {os.path.dirname(f) for _, f, _, _ in screened} == \
        {os.path.realpath(p) for p in paths.values()}
    assert checked and all(name.startswith("loraserve-read") and in_tier
                           for name, _, in_tier in checked), checked
    assert {p for _, p, _ in checked} == {paths[1], paths[2]}
    t.check()
    parts.shutdown()


def test_a_step_never_reuses_the_memory_of_an_entry_it_took():
    """A step's adapters outgrow the tier (one page, two adapters): the
    second read refuses the memory of the first, whose copy the caller has
    not issued yet, records nothing, and succeeds once the caller has
    issued that copy and ended the step (worker/paged_manager.py)."""
    fences: list[FakeFence] = []
    t = tier(pages=1, fences=fences)
    buf, _ = t.get(Req(0))  # its copy is queued after the step's other reads
    with pytest.raises(StepOverflow):
        t.get(Req(1))
    assert bool((buf == 0).all()), "entry 0 was overwritten before its copy"
    assert not fences and not t.failed_ids() and t.ids() == []  # its epoch still open
    t.check()
    t.end_step()  # the caller issued entry 0's copy
    assert len(fences) == 1 and not fences[0].done
    buf1, hit = t.get(Req(1))
    assert fences[0].waited, "the read reused entry 0's memory before its copy was done"
    assert not hit and bool((buf1 == 1).all()) and t.ids() == [1]
    t.end_step()
    t.check()


def test_a_step_frees_its_own_memory_before_it_waits_for_a_read_in_the_background():
    """The rest of the tier is held by a background read that is still
    reading: the step's read is refused at once (its caller frees the
    step's own entries in a few ms) rather than waiting for that read."""
    gate = threading.Event()
    t = tier(pages=2)
    assert t.prefetch(Req(5, gate=gate), ALIGN)
    deadline = time.monotonic() + 30
    while t.arena.used < ALIGN:  # the background read holds its page
        assert time.monotonic() < deadline, "the background read did not allocate"
        time.sleep(0.01)
    t.get(Req(0))
    raised: list[BaseException] = []

    def step_read() -> None:
        try:
            t.get(Req(1))
        except BaseException as e:  # noqa: BLE001 (what it raised is the result)
            raised.append(e)

    reader = threading.Thread(target=step_read)
    reader.start()
    try:
        reader.join(30)  # a tier that waited for the gated read would still wait
        assert not reader.is_alive(), "the step waited for the background read"
        assert len(raised) == 1 and isinstance(raised[0], StepOverflow), raised
        t.end_step()
        buf, _ = t.get(Req(1))
        assert bool((buf == 1).all())
    finally:
        gate.set()
        reader.join(30)
    t.end_step()
    settle(t)


def test_a_transient_read_failure_is_reported_once_then_read_again():
    """An I/O error (EIO) fails the requests waiting for the read (one
    report names it, as transient), not the adapter: the next hint reads
    it again, and that read serves."""
    t = tier(pages=2)
    assert t.prefetch(Req(7, error=OSError(errno.EIO, "Input/output error")), ALIGN)
    settle(t)
    report = t.report()
    assert report.transient == {7} and "OSError: [Errno 5] Input/output error" in \
        report.failed[7] and report.failed[7].endswith(TRANSIENT_NOTE)
    assert t.arena.used == 0 and 7 not in t
    assert not t.report().failed and not t.failed_ids()
    assert t.prefetch(Req(7), ALIGN)  # read again
    settle(t)
    assert t.report().host_ready == {7} and t.get(Req(7))[1] is True
    t.end_step()
    # The same on the engine thread: a step's own read.
    with pytest.raises(MemoryError):
        t.get(Req(8, error=MemoryError()))
    assert t.report().transient == {8} and not t.report().failed
    assert t.get(Req(8))[1] is False and 8 in t
    t.end_step()
    t.check()


@pytest.mark.parametrize("error", [
    BadWeights("tensor lora_B of m holds non-finite values (NaN or Inf)"),
    AdapterError("adapter_config.json in x is not valid JSON"),
    OSError(errno.ENOENT, "No such file or directory"),
    OSError("disk gone"),  # no errno: nothing says a retry may succeed
], ids=["nan", "malformed", "enoent", "no-errno"])
def test_a_content_failure_stays_until_a_runtime_add(error):
    t = tier(pages=2)
    assert t.prefetch(Req(7, error=error), ALIGN)
    settle(t)
    for _ in range(2):
        report = t.report()
        assert 7 in report.failed and not report.transient
        assert not report.failed[7].endswith(TRANSIENT_NOTE)
    assert not t.prefetch(Req(7), ALIGN)
    t.add(Req(7))
    assert not t.report().failed and 7 in t


def test_a_failed_page_load_is_transient_or_sticky_as_told():
    t = tier(pages=2)
    assert t.fail(3, "its pages could not be written: OutOfMemoryError", transient=True)
    assert not t.fail(3, "again", transient=True)  # one failure until it is reported
    report = t.report()
    assert report.transient == {3} and report.failed[3].startswith("its pages could not be")
    assert not t.report().failed
    # A sticky failure after a transient one (before the report) is sticky.
    t.fail(4, "out of memory", transient=True)
    assert not t.fail(4, "rank 64 is above the limit")
    for _ in range(2):
        assert t.report().failed == {4: "rank 64 is above the limit"}
    # A transient failure after a sticky one changes nothing.
    t.fail(4, "out of memory", transient=True)
    assert t.report() == PoolReport(frozenset(), {4: "rank 64 is above the limit"})


def test_is_transient():
    eio = OSError(errno.EIO, "Input/output error")
    wrapped = AdapterError("adapter_model.safetensors in x is unreadable")
    wrapped.__cause__ = eio
    for error in (eio, wrapped, OSError(errno.EAGAIN, "again"), MemoryError(),
                  torch.cuda.OutOfMemoryError("CUDA out of memory")):
        assert is_transient(error), error
    for error in (None, ValueError("rank 64 above the limit"), BadWeights("NaN"),
                  OSError(errno.EACCES, "Permission denied"), OSError("no errno"),
                  RuntimeError("a shape mismatch")):
        assert not is_transient(error), error


def test_an_io_error_inside_read_weights_is_transient(tmp_path, monkeypatch):
    """adapters/peft.py wraps the OSError of its positional reads in an
    AdapterError: its cause still tells a transient one."""
    from vllm_loraserve.adapters import peft

    w = {"model.layers.0.self_attn.q_proj": (torch.randn(4, 64), torch.randn(64, 4))}
    peft.write_adapter(str(tmp_path / "a"), w, rank=4, alpha=8.0, base_model="x")
    pread, calls = peft._pread_into, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return pread(*args)

    monkeypatch.setattr(peft, "_pread_into", flaky)
    t = HostTier(PinnedArena(8 * ALIGN, 1, pinned=False),
                 lambda req, alloc: peft.read_weights(req.path, alloc), threads=1)
    req = FileReq(1, str(tmp_path / "a"))
    with pytest.raises(AdapterError, match="unreadable"):
        t.get(req)
    report = t.report()
    assert report.transient == {1} and "Input/output error" in report.failed[1]
    assert t.get(req)[1] is False and 1 in t
    t.end_step()
    t.check()
