"""The PEFT format module: what it accepts, what it refuses and why."""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm_loraserve.adapters import peft
from vllm_loraserve.adapters.peft import (
    AdapterError,
    BadWeights,
    ModelLoRAInfo,
    check_against_model,
    check_finite_weights,
    inspect_adapter,
    load_adapter,
    read_weights,
    write_adapter,
)

DIMS = {"model.layers.0.self_attn.q_proj": (16, 16), "model.layers.0.mlp.down_proj": (32, 16)}
MODEL = ModelLoRAInfo({"q_proj": frozenset({(16, 16)}), "down_proj": frozenset({(32, 16)})}, 8)


def _write(path, rank=4, alpha=8, dims=DIMS, **kw):
    g = torch.Generator().manual_seed(0)
    weights = {m: (torch.randn(rank, i, generator=g), torch.randn(o, rank, generator=g))
               for m, (i, o) in dims.items()}
    write_adapter(str(path), weights, rank=rank, alpha=alpha, base_model="test/base", **kw)
    return str(path)


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(changes)
    json.dump(cfg, open(cfg_path, "w"))


def test_inspect_reads_rank_alpha_targets_and_size(tmp_path):
    spec = inspect_adapter(_write(tmp_path / "a", rank=4, alpha=8))
    assert (spec.rank, spec.alpha, spec.scaling) == (4, 8.0, 2.0)
    assert spec.target_modules == ["down_proj", "q_proj"]
    assert spec.size_bytes == 4 * (4 * 16 + 16 * 4) + 4 * (4 * 32 + 16 * 4)  # fp32
    assert spec.modules["model.layers.0.mlp.down_proj"].in_features == 32
    check_against_model(spec, MODEL)  # fits


def test_load_adapter_returns_the_written_weights(tmp_path):
    path = _write(tmp_path / "a", rank=4, alpha=8)
    spec, weights = load_adapter(path)
    assert spec == inspect_adapter(path) and weights.keys() == DIMS.keys()
    g = torch.Generator().manual_seed(0)  # _write's draws, in its order
    for module, (n_in, n_out) in DIMS.items():
        a, b = torch.randn(4, n_in, generator=g), torch.randn(n_out, 4, generator=g)
        assert torch.equal(weights[module][0], a) and torch.equal(weights[module][1], b)


def _alloc(n):
    return torch.empty(n, dtype=torch.uint8)


@pytest.fixture(scope="module")
def executor():
    with ThreadPoolExecutor(3) as pool:
        yield pool


@pytest.fixture(params=["whole", "parts"])
def read(request, executor):
    """read_weights, whole or split over threads in pieces of 600 bytes (the
    test files hold 1-2 KB of tensors of 128-512 bytes: several pieces, cut
    inside tensors, and several tensors per check group)."""
    if request.param == "whole":
        return read_weights
    return functools.partial(read_weights, parts=executor, part_bytes=600)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_read_weights_holds_the_files_tensors_in_one_buffer(tmp_path, fmt, read):
    """The host tier's read: the same tensors as load_adapter, as views of
    one buffer, in the file's dtype; mixed dtypes (fp32 A with bf16 B puts
    tensors at offsets their dtype does not divide) included."""
    g = torch.Generator().manual_seed(1)
    weights = {m: (torch.randn(3, i, generator=g), torch.randn(o, 3, generator=g).bfloat16())
               for m, (i, o) in DIMS.items()}
    path = str(tmp_path / "a")
    write_adapter(path, weights, rank=3, alpha=6, base_model="x")
    if fmt == "bin":
        from safetensors.torch import load_file

        st = os.path.join(path, "adapter_model.safetensors")
        torch.save(load_file(st), os.path.join(path, "adapter_model.bin"))
        os.remove(st)
    spec, raw = read(path, _alloc)
    assert spec == inspect_adapter(path)
    assert raw.data.dtype == torch.uint8 and raw.data.numel() == spec.size_bytes
    got = raw.tensors()
    assert got.keys() == weights.keys()
    for m, (a, b) in weights.items():
        assert got[m][0].dtype == torch.float32 and torch.equal(got[m][0], a)
        assert got[m][1].dtype == torch.bfloat16 and torch.equal(got[m][1], b)
    copy = raw.data.clone()  # what a device copy of the buffer gives
    raw.data.zero_()
    assert all(torch.equal(raw.tensors(copy)[m][0], a) for m, (a, _) in weights.items())


class _Counting(ThreadPoolExecutor):
    submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_a_split_read_offers_its_pieces_to_the_threads_and_ends_every_piece_before_failing(
        tmp_path, monkeypatch):
    """With `parts`, every piece of the read and of the check but the one the
    caller starts with is offered to the executor; a piece whose read fails
    is an AdapterError only once every piece that started has ended (none
    may still write into a buffer its caller frees), and no piece starts
    after it."""
    path = _write(tmp_path / "a")
    with _Counting(3) as pool:
        spec, raw = read_weights(path, _alloc, BF16_MAX, parts=pool, part_bytes=64)
        pieces = -(-raw.data.numel() // 64)
        # Values that pass are screened in the pieces of the read, in one pass.
        assert pool.submitted == pieces - 1 and pieces > 4
    started, ended = [], []
    second = threading.Event()
    pread = peft._pread_into

    def failing_once_another_runs(fd, view, start, lo, hi):
        started.append(lo)
        if lo == 0:
            assert second.wait(5)
            raise OSError(5, "Input/output error")
        second.set()
        time.sleep(0.1)
        got = pread(fd, view, start, lo, hi)
        ended.append(lo)
        return got

    monkeypatch.setattr(peft, "_pread_into", failing_once_another_runs)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(AdapterError, match="unreadable: .*Input/output error"):
            read_weights(path, _alloc, parts=pool, part_bytes=64)
        assert sorted(started) == [0] + sorted(ended) and len(ended) >= 1
        assert len(started) < pieces


def test_a_split_read_goes_on_while_the_executor_is_busy(tmp_path):
    """Every thread of `parts` is taken (other reads, a hung file): the read
    runs on its caller's thread, whole, and leaves no task behind."""
    path = _write(tmp_path / "a")
    release = threading.Event()
    with _Counting(1) as pool:
        busy = pool.submit(release.wait, 30)
        spec, raw = read_weights(path, _alloc, BF16_MAX, parts=pool, part_bytes=64)
        assert not busy.done()  # the read did not wait for the busy thread
        release.set()
        whole = read_weights(path, _alloc)[1]
        assert torch.equal(raw.data, whole.data) and pool.submitted > 2


def test_read_weights_refuses_a_file_that_changed(tmp_path, monkeypatch, read):
    """A file cut short after its header was checked (the engine reads long
    after the API server inspected it) is an AdapterError, not a short buffer."""
    path = _write(tmp_path / "a")
    spec = inspect_adapter(path)
    f = os.path.join(path, "adapter_model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:len(data) - 8])
    monkeypatch.setattr("vllm_loraserve.adapters.peft.inspect_adapter", lambda p: spec)
    with pytest.raises(AdapterError, match="changed while being read"):
        read(path, _alloc)


def test_load_adapter_refuses_truncated_weights(tmp_path):
    path = _write(tmp_path / "a")
    f = os.path.join(path, "adapter_model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:len(data) // 2])
    with pytest.raises(AdapterError, match="unreadable"):
        load_adapter(path)


def test_rslora_scaling(tmp_path):
    spec = inspect_adapter(_write(tmp_path / "a", rank=4, alpha=8, use_rslora=True))
    assert spec.scaling == pytest.approx(8 / math.sqrt(4))


def test_written_adapter_is_real_peft(tmp_path):
    """PEFT itself loads what write_adapter writes, with the same scaling."""
    peft = pytest.importorskip("peft")
    path = _write(tmp_path / "a", rank=4, alpha=12)
    cfg = peft.PeftConfig.from_pretrained(path)
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)) == (4, 12, ["down_proj", "q_proj"])


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
    ({"r": 0}, "positive integer"),
    ({"r": 8}, "says r=8"),
    ({"lora_alpha": "big"}, "lora_alpha"),
    ({"lora_alpha": float("nan")}, "'lora_alpha' must be a finite number, got nan"),
    ({"lora_alpha": float("inf")}, "'lora_alpha' must be a finite number, got inf"),
    ({"peft_type": "IA3"}, "only LORA"),
    # strings are truthy: "false" would have served rsLoRA's scaling
    ({"use_rslora": "false"}, "'use_rslora' must be true or false, got 'false'"),
    ({"use_dora": "false"}, "'use_dora' must be true or false"),
    ({"lora_bias": 1}, "'lora_bias' must be true or false"),
    ({"bias": ["none"]}, "'bias' must be a string"),
])
def test_refused_configs(tmp_path, change, message):
    path = _write(tmp_path / "a")
    _edit_config(path, **change)
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(path)


def test_json_false_and_null_flags_are_served_as_false(tmp_path):
    path = _write(tmp_path / "a", rank=4, alpha=8)
    _edit_config(path, use_rslora=False, use_dora=None, bias=None, lora_bias=False)
    spec = inspect_adapter(path)
    assert not spec.use_rslora and spec.scaling == 2.0


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("dtype, name", [(torch.float64, "F64"), (torch.int8, "I8"),
                                         (torch.float8_e4m3fn, "F8_E4M3")])
def test_weights_of_a_dtype_the_pools_do_not_serve_are_refused(tmp_path, fmt, dtype, name):
    """Only bf16, fp16 and fp32 are served (the paged pool's reader takes no
    other); the values check could not read fp8 on the CPU (aminmax)."""
    from safetensors.torch import load_file, save_file

    path = _write(tmp_path / "a")
    st = os.path.join(path, "adapter_model.safetensors")
    tensors = {k: t.to(dtype) for k, t in load_file(st).items()}
    if fmt == "bin":
        torch.save(tensors, os.path.join(path, "adapter_model.bin"))
        os.remove(st)
    else:
        save_file(tensors, st)
    if fmt == "bin":  # torch's name
        name = str(dtype).removeprefix("torch.")
    with pytest.raises(AdapterError, match=rf"weights of dtype\(s\) \['{name}'\]; LoRA "
                                           r"weights must be one of \['BF16', 'F16', 'F32'\]"):
        inspect_adapter(path)


def test_a_config_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    path = _write(tmp_path / "a")
    cfg = os.path.join(path, "adapter_config.json")
    os.remove(cfg)
    os.mkfifo(cfg)  # opening it for reading would wait for a writer
    with pytest.raises(AdapterError, match="adapter_config.json in .* is not a regular file"):
        inspect_adapter(path)


def test_missing_config(tmp_path):
    path = _write(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        inspect_adapter(path)


def test_config_not_json(tmp_path):
    path = _write(tmp_path / "a")
    open(os.path.join(path, "adapter_config.json"), "w").write("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        inspect_adapter(path)


def test_missing_weights(tmp_path):
    path = _write(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        inspect_adapter(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_safetensors(tmp_path, damage):
    path = _write(tmp_path / "a")
    st = os.path.join(path, "adapter_model.safetensors")
    data = open(st, "rb").read()
    open(st, "wb").write(b"garbage" * 9 if damage == "garbage" else data[:-10])
    with pytest.raises(AdapterError, match="unreadable"):
        inspect_adapter(path)


def test_missing_directory(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        inspect_adapter(str(tmp_path / "nope"))


def _write_raw(path, tensors, rank=4):
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]},
              open(os.path.join(path, "adapter_config.json"), "w"))
    return str(path)


P = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("tensors, message", [
    ({f"{P}.lora_A.weight": torch.zeros(4, 16)}, "no lora_B"),
    ({f"{P}.lora_A.weight": torch.zeros(4, 16), f"{P}.lora_B.weight": torch.zeros(16, 3)},
     "rank 4 but lora_B has rank 3"),
    ({f"{P}.lora_A.weight": torch.zeros(4, 16, 1), f"{P}.lora_B.weight": torch.zeros(16, 4)},
     "2-D"),
    ({f"{P}.weight": torch.zeros(4, 16)}, "not a LoRA A/B weight"),
    ({}, "no tensors"),
])
def test_malformed_tensors(tmp_path, tensors, message):
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(_write_raw(tmp_path / "a", tensors))


def test_rank_above_server_maximum(tmp_path):
    spec = inspect_adapter(_write(tmp_path / "a", rank=16, alpha=16))
    with pytest.raises(AdapterError, match="rank 16 is above this server's maximum LoRA rank 8"):
        check_against_model(spec, MODEL)


def test_unsupported_target_module(tmp_path):
    dims = {**DIMS, "model.layers.0.self_attn.rotary_proj": (16, 16)}
    spec = inspect_adapter(_write(tmp_path / "a", dims=dims))
    with pytest.raises(AdapterError, match=r"unsupported target module\(s\) \['rotary_proj'\]"):
        check_against_model(spec, MODEL)


def test_wrong_base_model(tmp_path):
    dims = {"model.layers.0.self_attn.q_proj": (32, 32)}
    spec = inspect_adapter(_write(tmp_path / "a", dims=dims))
    with pytest.raises(AdapterError,
                       match="does not fit this base model.*in=32, out=32.*test/base"):
        check_against_model(spec, MODEL)


@pytest.mark.parametrize("path", ["model.layers.7.self_attn.q_proj",  # a layer it lacks
                                  "model.layers.0.mlp.q_proj",  # q_proj elsewhere
                                  "q_proj"])
def test_module_path_the_model_lacks(tmp_path, path):
    """Issue 22: short names and shapes fit, the path does not (a layer index
    past the model's last killed the engine at the adapter's page load)."""
    model = ModelLoRAInfo(MODEL.shapes, MODEL.max_rank, frozenset(DIMS))
    spec = inspect_adapter(_write(tmp_path / "a", dims={**DIMS, path: (16, 16)}))
    with pytest.raises(AdapterError, match=rf"targets {path}, which this model does not have"):
        check_against_model(spec, model)
    check_against_model(spec, MODEL)  # shapes alone cannot tell
    check_against_model(inspect_adapter(_write(tmp_path / "b")), model)
    assert ModelLoRAInfo.from_wire(model.to_wire(), 8) == model


def test_embedding_adapter_shapes(tmp_path):
    path = _write_raw(tmp_path / "a", {
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 100),
        "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(16, 4)})
    m = inspect_adapter(path).modules["model.embed_tokens"]
    assert (m.in_features, m.out_features, m.embedding) == (100, 16, True)



BF16_MAX = torch.finfo(torch.bfloat16).max
FP16_MAX = torch.finfo(torch.float16).max


def test_non_finite_weights(tmp_path):
    path = _write(tmp_path / "a")
    check_finite_weights(inspect_adapter(path), BF16_MAX)  # finite: passes
    from safetensors.torch import load_file, save_file

    st = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(st)
    key = sorted(tensors)[1]
    tensors[key][0, 0] = float("inf")
    save_file(tensors, st)
    spec = inspect_adapter(path)  # the header is fine
    with pytest.raises(AdapterError, match=f"tensor '{key}' holds non-finite values"):
        check_finite_weights(spec, BF16_MAX)


def _b_max(path):
    _, weights = load_adapter(path)
    return max(float(b.abs().max()) for _, b in weights.values())


def test_scaling_that_overflows_the_serving_dtype_is_refused(tmp_path):
    """The pool folds the scaling into B: scaling * max|B| must be finite in
    the serving dtype (fp16 refuses what bf16 holds), and so must the scaling."""
    spec = inspect_adapter(_write(tmp_path / "a", rank=4, alpha=8))
    check_finite_weights(spec, FP16_MAX)
    b_max = _b_max(spec.path)
    # scaling * max|B| just above fp16's largest value, far inside bf16's
    big = inspect_adapter(_write(tmp_path / "big", rank=4, alpha=4 * 1.01 * FP16_MAX / b_max))
    check_finite_weights(big, BF16_MAX)
    with pytest.raises(AdapterError, match=r"scaling .* \(lora_alpha .* / r=4\) times the "
                       r"largest \|lora_B\| weight .* above 6\.55e\+04.*lora_alpha is too "
                       "large"):
        check_finite_weights(big, FP16_MAX)
    absurd = inspect_adapter(_write(tmp_path / "absurd", rank=4, alpha=1e30))
    with pytest.raises(AdapterError, match=r"scaling 2\.5e\+29 \(lora_alpha 1e\+30 / r=4\) "
                       r"is above 6\.55e\+04, the largest value of the serving dtype"):
        check_finite_weights(absurd, FP16_MAX)
    check_finite_weights(absurd, BF16_MAX)  # representable in bf16: not refused
    # the scaling alone beyond the dtype, though B is all zeros (a fresh LoRA)
    w = {m: (torch.ones(4, i), torch.zeros(o, 4)) for m, (i, o) in DIMS.items()}
    write_adapter(str(tmp_path / "zero-b"), w, rank=4, alpha=2e39, base_model="x")
    with pytest.raises(AdapterError, match=r"scaling 5e\+38 .* is above 3\.39e\+38"):
        check_finite_weights(inspect_adapter(str(tmp_path / "zero-b")), BF16_MAX)
    rs = inspect_adapter(_write(tmp_path / "rs", rank=4, alpha=1e39, use_rslora=True))
    with pytest.raises(AdapterError, match=r"scaling 5e\+38 \(lora_alpha 1e\+39 / "
                       r"sqrt\(r=4\), rsLoRA\) is above 3\.39e\+38"):
        check_finite_weights(rs, BF16_MAX)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_nan_or_inf_is_found_wherever_it_lies(dtype):
    """The check's one reduction (torch.aminmax) propagates NaN and Inf from
    any element: vector lanes, tails and the first element alike."""
    from vllm_loraserve.adapters.peft import _abs_max

    for n in (1, 7, 16, 33, 67, 1031):
        t = -torch.arange(n, dtype=torch.float32).to(dtype)
        assert _abs_max(t) == float(t.float().abs().max())
        for i in {0, n // 2, n - 1}:
            for bad in (math.nan, math.inf, -math.inf):
                u = t.clone()
                u[i] = bad
                assert not math.isfinite(_abs_max(u)), (n, i, bad)


def _break(path, value, kind="lora_B"):
    """One weight of `kind` set to `value`; its key."""
    from safetensors.torch import load_file, save_file

    st = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(st)
    key = next(k for k in sorted(tensors) if kind in k)
    tensors[key][0, 0] = value
    save_file(tensors, st)
    return key


def test_read_weights_checks_the_values_in_the_buffer_it_fills(tmp_path, read):
    """The paged pool's read (`max_value`) refuses what check_finite_weights
    refuses, from the bytes it read: NaN/Inf in A or B, a scaling, or
    scaling * max|B|, beyond the serving dtype."""
    ok = _write(tmp_path / "ok", rank=4, alpha=8)
    spec, raw = read(ok, _alloc, FP16_MAX)
    assert spec == inspect_adapter(ok) and raw.modules.keys() == DIMS.keys()
    for kind, value in (("lora_A", math.nan), ("lora_B", -math.inf)):
        path = _write(tmp_path / kind, rank=4, alpha=8)
        module = _break(path, value, kind).removeprefix("base_model.model.") \
            .removesuffix(f".{kind}.weight")
        with pytest.raises(BadWeights, match=rf"tensor {kind} of {module} holds non-finite "
                           r"values \(NaN or Inf\)"):
            read(path, _alloc, BF16_MAX)
        read(path, _alloc)  # no max_value: the bytes only
    big = _write(tmp_path / "big", rank=4, alpha=4 * 1.01 * FP16_MAX / _b_max(ok))
    read(big, _alloc, BF16_MAX)
    with pytest.raises(BadWeights, match=r"times the largest \|lora_B\| weight .* above "
                       r"6\.55e\+04.*lora_alpha is too large"):
        read(big, _alloc, FP16_MAX)
    with pytest.raises(BadWeights, match=r"scaling 2\.5e\+29 .* is above 6\.55e\+04"):
        read(_write(tmp_path / "absurd", rank=4, alpha=1e30), _alloc, FP16_MAX)


def test_values_that_pass_are_screened_as_they_are_read(tmp_path, monkeypatch):
    """An adapter whose values pass takes one screen per piece of its file's
    data, as the piece is read, and no reduction per tensor. Large A values
    fail the screen (scaling * max|value| beyond the dtype), yet pass the
    tensor by tensor check that follows: only B takes the scaling."""
    screened, per_tensor = [], []
    bits, abs_max = peft.abs_max_bits, peft._abs_max
    monkeypatch.setattr(peft, "abs_max_bits",
                        lambda b, dt: screened.append((memoryview(b).nbytes, dt)) or bits(b, dt))
    monkeypatch.setattr(peft, "_abs_max", lambda t: per_tensor.append(t.numel()) or abs_max(t))
    ok = _write(tmp_path / "ok", rank=4, alpha=8)
    raw = read_weights(ok, _alloc, FP16_MAX)[1]
    assert screened == [(raw.data.numel(), "F32")] and not per_tensor  # every byte, once
    big_a = _write(tmp_path / "big-a", rank=4, alpha=8)  # scaling 2
    _break(big_a, 1e5, "lora_A")
    screened.clear()
    raw = read_weights(big_a, _alloc, FP16_MAX)[1]
    assert len(screened) == 1 and len(per_tensor) == 2 * len(DIMS)
    assert float(abs_max(raw.data.view(torch.float32))) == 1e5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_screen_reads_max_abs_value_from_the_bits(dtype):
    """`abs_max_bits` agrees with torch's max|x|, in every dtype the pools
    serve: all negative, all positive, -0, subnormals, the largest finite
    value, Inf of either sign and NaN (which wins over Inf)."""
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(100_003, generator=g) * 100).to(dtype)

    def screen(t):
        return peft.abs_max_bits(t.view(torch.uint8).numpy(), name)

    assert screen(x) == float(x.abs().max()) and screen(x[:0]) == 0
    for one_sign in (x.abs(), -x.abs(), -x.abs() / 1e3 + 1e-3):
        assert screen(one_sign) == float(one_sign.abs().max())
    x[-1] = -info.max
    assert screen(x) == info.max
    tiny = torch.tensor([-0.0, info.smallest_normal / 4, -info.smallest_normal / 2], dtype=dtype)
    assert screen(tiny) == float(tiny.abs().max()) > 0
    x[70_001] = -math.inf
    assert screen(x) == math.inf
    x[7] = math.nan
    assert math.isnan(screen(x))


# adapter_config.json bytes -> what the message says. Every parser failure
# (RecursionError, UnicodeDecodeError, OverflowError, ...) is an AdapterError.
DEEP = b"[" * 100_000 + b"]" * 100_000
CONFIG_DAMAGE = {
    "deep-nesting": (DEEP, "not valid JSON: RecursionError"),
    "deep-value": (b'{"r": 4, "lora_alpha": ' + DEEP + b"}", "not valid JSON: RecursionError"),
    "invalid-utf8": (b'{"r": 4, "lora_alpha": 8, "x": "\xff\xfe\xfa"}',
                     "not valid JSON: UnicodeDecodeError"),
    "huge-float": (b'{"r": 4, "lora_alpha": 1e999}',
                   "'lora_alpha' must be a finite number, got inf"),
    "huge-r": (b'{"r": 1e400, "lora_alpha": 8}', "'r' must be a positive integer, got inf"),
    "huge-int-alpha": (b'{"r": 4, "lora_alpha": 1' + b"0" * 400 + b"}",
                       "'lora_alpha' must be a finite number, got 1000"),
    "too-many-digits": (b'{"r": 4, "lora_alpha": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    "nan-literal": (b'{"r": 4, "lora_alpha": NaN}',
                    "'lora_alpha' must be a finite number, got nan"),
    "list": (b"[1, 2]", "must hold a JSON object"),
    "null": (b"null", "must hold a JSON object"),
    "empty": (b"", "not valid JSON"),
    "long-value": (b'{"r": 4, "lora_alpha": "' + b"x" * 1_000_000 + b'"}', "finite number"),
    "nested-peft-type": (b'{"r": 4, "lora_alpha": 8, "peft_type": ' + b"[" * 900 + b"]" * 900
                         + b"}", r"peft_type is \[\[\[\.\.\.\]\]\], only LORA"),
    "base-model-object": (b'{"r": 4, "lora_alpha": 8, "base_model_name_or_path": {"a": 1}}',
                          "'base_model_name_or_path' must be a string"),
    "too-large": (b'{"r": 4, "lora_alpha": 8' + b" " * (17 << 20) + b"}", "larger than"),
}


@pytest.mark.parametrize("damage", sorted(CONFIG_DAMAGE))
def test_malformed_config_is_an_adapter_error(tmp_path, damage):
    data, message = CONFIG_DAMAGE[damage]
    path = _write(tmp_path / "a")
    with open(os.path.join(path, "adapter_config.json"), "wb") as f:
        f.write(data)
    with pytest.raises(AdapterError, match=message) as e:
        inspect_adapter(path)
    assert len(str(e.value)) < 1000  # a message, not the file


@pytest.mark.parametrize("kind", ["directory", "dangling-symlink", "no-permission"])
def test_unreadable_config_is_an_adapter_error(tmp_path, kind):
    path = _write(tmp_path / "a")
    cfg = os.path.join(path, "adapter_config.json")
    os.remove(cfg)
    if kind == "directory":
        os.mkdir(cfg)
    elif kind == "dangling-symlink":
        os.symlink(tmp_path / "nowhere", cfg)
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their permissions")
        open(cfg, "w").write("{}")
        os.chmod(cfg, 0)
    with pytest.raises(AdapterError, match="adapter_config.json in .* is unreadable"):
        inspect_adapter(path)


def _safetensors(path, header, data=b"", n=None):
    """A raw safetensors file: an 8-byte length (`n`, default the header's),
    the header (JSON of an object, or bytes as given), the data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write((len(raw) if n is None else n).to_bytes(8, "little") + raw + data)


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
# header -> what the message says, for read_weights' own reader of the
# header (the engine's read, long after the API server inspected the file).
HEADER_DAMAGE = {
    "huge-length": (dict(header={}, n=1 << 62), "header length 4611686018427387904 does not "
                    "fit the file"),
    "length-past-end": (dict(header={}, n=1000), "header length 1000 does not fit"),
    "short-file": (dict(header=b"", n=None), "header length 0|not valid JSON"),
    "not-json": (dict(header=b"{not json"), "not valid JSON"),
    "deep": (dict(header=DEEP), "not valid JSON: RecursionError"),
    "list": (dict(header=[1, 2]), "header is not a JSON object"),
    "entry-not-object": (dict(header={KEY: 5}), "is not a tensor: 5"),
    "no-offsets": (dict(header={KEY: {"dtype": "F32", "shape": [1]}}), "is not a tensor"),
    "negative-offset": (dict(header={KEY: {"dtype": "F32", "shape": [1],
                                           "data_offsets": [-4, 0]}}, data=b"\0" * 4),
                        "is not a tensor"),
    "wrong-size": (dict(header={KEY: {"dtype": "F32", "shape": [2],
                                      "data_offsets": [0, 4]}}, data=b"\0" * 8),
                   "is not a tensor"),
    "float-shape": (dict(header={KEY: {"dtype": "F32", "shape": [1.5],
                                       "data_offsets": [0, 6]}}, data=b"\0" * 8),
                    "is not a tensor"),
    "odd-dtype": (dict(header={KEY: {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}},
                       data=b"\0"), "is not a tensor"),
    "past-the-data": (dict(header={KEY: {"dtype": "F32", "shape": [4],
                                         "data_offsets": [0, 16]}}, data=b"\0" * 8),
                      "changed while being read"),
}


@pytest.mark.parametrize("damage", sorted(HEADER_DAMAGE))
def test_malformed_safetensors_header_is_an_adapter_error(tmp_path, monkeypatch, damage):
    """Refused by the inspection (the safetensors library's reader) and by
    read_weights' own reader, with bounded memory: no allocation of the
    length a header claims."""
    kw, message = HEADER_DAMAGE[damage]
    path = _write(tmp_path / "a")
    spec = inspect_adapter(path)
    _safetensors(path, **kw)
    with pytest.raises(AdapterError, match="unreadable|no tensors"):
        inspect_adapter(path)
    monkeypatch.setattr("vllm_loraserve.adapters.peft.inspect_adapter", lambda p: spec)
    with pytest.raises(AdapterError, match=message):
        read_weights(path, _alloc)


def test_safetensors_header_length_is_capped(tmp_path, monkeypatch):
    """A header longer than the cap is refused even where the file holds it
    (the cap, 100 MB as in the safetensors library, made small here)."""
    path = _write(tmp_path / "a")
    spec = inspect_adapter(path)
    _safetensors(path, b"{}" + b" " * 999)
    monkeypatch.setattr("vllm_loraserve.adapters.peft.MAX_HEADER_BYTES", 1000)
    monkeypatch.setattr("vllm_loraserve.adapters.peft.inspect_adapter", lambda p: spec)
    with pytest.raises(AdapterError, match="header length 1001 .* at most 1000"):
        read_weights(path, _alloc)


@pytest.mark.parametrize("content", ["tensor", "list", "dict-of-ints"])
def test_bin_that_is_not_named_tensors_is_an_adapter_error(tmp_path, content):
    path = _write(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    obj = {"tensor": torch.zeros(3), "list": [1, 2], "dict-of-ints": {"a": 1}}[content]
    torch.save(obj, os.path.join(path, "adapter_model.bin"))
    for read in (inspect_adapter, load_adapter, lambda p: read_weights(p, _alloc)):
        with pytest.raises(AdapterError, match="does not hold a dict of named tensors"):
            read(path)
