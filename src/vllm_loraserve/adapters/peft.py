"""The PEFT LoRA adapter format: inspect, validate against a model, write.

A PEFT LoRA adapter is a directory with `adapter_config.json` and
`adapter_model.safetensors` (or the older `adapter_model.bin`). Each adapted
module `M` contributes `base_model.model.<M>.lora_A.weight` of shape
`[r, in]` and `...lora_B.weight` of shape `[out, r]`; embeddings use
`lora_embedding_A` `[r, vocab]` / `lora_embedding_B` `[dim, r]`. The delta is
`scaling * B @ A` with `scaling = alpha / r` (rsLoRA: `alpha / sqrt(r)`).

`inspect_adapter` reads only the config and the safetensors header, so
cataloguing thousands of adapters costs no tensor reads. `check_weight_values`
refuses NaN/Inf and a scaling that overflows the serving dtype: over the
buffer `read_weights` fills (the paged pool's reader, so an adapter's files
are read once), or over the files (`check_finite_weights`: the cluster
router, and the API server of `--loraserve-pool vllm`). `check_against_model`
compares the result with what the served model accepts. All raise or return
messages written for the person who sent the adapter.

Every failure to read or parse an adapter's files is an `AdapterError` (the
parsers also raise RecursionError, UnicodeDecodeError, OverflowError, ...):
one bad adapter is that adapter's problem, never its caller's. Whether the
files may be read at all (symlinks out of the adapter roots) is decided by
the callers that know the roots (adapters/safety.py).
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
_PREFIX = "base_model.model."
_KINDS = {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
# What the pools serve (and the values check reads): a header may declare the rest.
# Safetensors name -> torch dtype, by name: torch is imported only where tensors are read.
_WEIGHT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
WEIGHT_DTYPES = tuple(_WEIGHT_DTYPES)
_TORCH_NAMES = {f"torch.{t}": st for st, t in _WEIGHT_DTYPES.items()}
# A PEFT config is a few KB; a safetensors header is bounded as the
# safetensors library bounds it (MAX_HEADER_SIZE), so a length field or a
# file of gigabytes costs no more than this much memory.
MAX_CONFIG_BYTES = 16 << 20
# A piece of an adapter's read and check when they are split over threads:
# large enough that a task's overhead (~50 us) is noise, small enough that a
# rank-16 Llama-2-7B adapter (34 MB) spreads over a few threads.
PART_BYTES = 8 << 20
MAX_HEADER_BYTES = 100_000_000
# Values from a file shown in messages: nesting and length cut short.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_show = _REPR.repr


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


class BadWeights(AdapterError):
    """Weights that read fine but cannot be served: NaN or Inf, or a scaling
    that overflows the serving dtype (`check_weight_values`)."""


@dataclass(frozen=True)
class ModuleShape:
    """One adapted module: A is [rank, in_features], B is [out_features, rank]."""

    rank: int
    in_features: int
    out_features: int
    embedding: bool = False


@dataclass(frozen=True)
class PeftSpec:
    """What a PEFT adapter directory holds, read from its config and header
    (the adapter by name alone is `record.AdapterRecord`)."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    base_model: str | None
    size_bytes: int
    modules: Mapping[str, ModuleShape] = field(repr=False)
    """Full module path (PEFT prefix stripped) -> shapes."""

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def target_modules(self) -> list[str]:
        """Short names of the adapted modules (e.g. q_proj), sorted."""
        return sorted({short_name(m) for m in self.modules})


def short_name(module_path: str) -> str:
    return module_path.rsplit(".", 1)[-1]


def _parse_json(data: bytes, what: str) -> Any:
    """JSON from an adapter file. The parser fails with more than ValueError
    (RecursionError for deep nesting, MemoryError): all are this file's
    AdapterError."""
    try:
        return json.loads(data)
    except Exception as e:
        raise AdapterError(f"{what} is not valid JSON: {type(e).__name__}: {e}") from None


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(cfg_path):
        raise AdapterError(f"{CONFIG_FILE} is missing in {path}")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (a reader's thread,
        # or the API server's, would hang); anything but a regular file is refused.
        fd = os.open(cfg_path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise AdapterError(f"{CONFIG_FILE} in {path} is not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:  # a directory, a dangling symlink, no permission
        raise AdapterError(f"{CONFIG_FILE} in {path} is unreadable: {e}") from e
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} in {path} is larger than {MAX_CONFIG_BYTES} bytes")
    cfg = _parse_json(data, f"{CONFIG_FILE} in {path}")
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} in {path} must hold a JSON object")
    return cfg


def _finite(x: Any) -> float | None:
    """`x` as a float if it is a finite JSON number (not a bool), else None;
    an integer too large for a float (`1` and 400 zeros) is not finite."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _check_config(cfg: dict[str, Any]) -> tuple[int, float, bool]:
    problems = []
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        problems.append(f"peft_type is {_show(peft_type)}, only LORA adapters are served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"'r' must be a positive integer, got {_show(r)}")
    if _finite(alpha) is None:
        problems.append(f"'lora_alpha' must be a finite number, got {_show(alpha)}")
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        problems.append(f"'base_model_name_or_path' must be a string, got {_show(base)}")
    # JSON booleans only: the string "false" is truthy, and would be served as true.
    flags = {key: cfg.get(key) or False for key in ("use_rslora", "use_dora", "lora_bias")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            problems.append(f"'{key}' must be true or false, got {_show(value)}")
    if flags["use_dora"] is True:
        problems.append("DoRA adapters (use_dora) are not supported by vLLM")
    if cfg.get("modules_to_save"):
        problems.append("modules_to_save is not supported by vLLM")
    bias = cfg.get("bias") or "none"
    if not isinstance(bias, str):
        problems.append(f"'bias' must be a string, got {_show(bias)}")
    elif bias != "none" or flags["lora_bias"] is True:
        problems.append("adapter bias terms are not supported by vLLM")
    # vLLM applies one scaling to every module; per-module patterns would be
    # served with wrong numbers, so refuse them instead.
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            problems.append(f"per-module {key} is not supported by vLLM's LoRA loader")
    if problems:
        raise AdapterError("; ".join(problems))
    return r, float(alpha), flags["use_rslora"]


def _tensor_shapes(path: str) -> tuple[dict[str, tuple[list[int], str]], int]:
    """Key -> (shape, dtype) and total tensor bytes, without reading tensor data."""
    st_path, bin_path = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, BIN_FILE)
    if os.path.isfile(st_path):
        from safetensors import safe_open

        try:
            shapes = {}
            with safe_open(st_path, framework="numpy") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    shapes[key] = (list(s.get_shape()), s.get_dtype())
        except Exception as e:  # the library raises its own error types
            raise AdapterError(f"{SAFETENSORS_FILE} in {path} is unreadable: {e}") from e
        _check_dtypes(shapes, SAFETENSORS_FILE, path)
        size = sum(math.prod(shape) * _DTYPE_BYTES[dt] for shape, dt in shapes.values())
        return shapes, size
    if os.path.isfile(bin_path):
        state = _load_bin(path)
        shapes = {k: (list(v.shape), _TORCH_NAMES.get(str(v.dtype),
                                                      str(v.dtype).removeprefix("torch.")))
                  for k, v in state.items()}
        _check_dtypes(shapes, BIN_FILE, path)
        return shapes, sum(v.numel() * v.element_size() for v in state.values())
    raise AdapterError(f"no {SAFETENSORS_FILE} (or {BIN_FILE}) in {path}")


def _check_dtypes(shapes: dict[str, tuple[list[int], str]], file: str, path: str) -> None:
    odd = sorted({dt for _, dt in shapes.values()} - set(WEIGHT_DTYPES))
    if odd:
        raise AdapterError(f"{file} in {path} has weights of dtype(s) {odd}; LoRA weights "
                           f"must be one of {list(WEIGHT_DTYPES)}")


def _split_key(key: str) -> tuple[str, str]:
    """A PEFT tensor key -> (module path without the PEFT prefix, kind)."""
    stem = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
    module, _, kind = stem.removesuffix(".weight").rpartition(".")
    return module, kind


def _load_bin(path: str) -> dict[str, Any]:
    """The tensors of an adapter directory's adapter_model.bin: a pickle may
    hold anything, so anything but a dict of named tensors is refused."""
    import torch

    try:
        state = torch.load(os.path.join(path, BIN_FILE), map_location="cpu", weights_only=True,
                           mmap=True)
    except Exception as e:  # torch raises its own and pickle's error types
        raise AdapterError(f"the adapter weights in {path} are unreadable: {BIN_FILE}: "
                           f"{e}") from e
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise AdapterError(f"the adapter weights in {path} are unreadable: {BIN_FILE} does "
                           "not hold a dict of named tensors")
    return state


def _read_tensors(path: str) -> dict[str, Any]:
    """Every tensor of an adapter directory's weights file, on the CPU."""
    st_path = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.isfile(st_path):
        return _load_bin(path)
    from safetensors.torch import load_file

    try:
        return load_file(st_path)
    except Exception as e:  # the library raises its own error types
        raise AdapterError(f"the adapter weights in {path} are unreadable: {e}") from e


def _groups(sizes: list[int], part_bytes: float) -> list[range]:
    """Consecutive indices of `sizes` in runs of at least `part_bytes` (the
    last may be less), each ending at the first index that reaches it."""
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total >= part_bytes:
            out.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes) or not out:
        out.append(range(start, len(sizes)))
    return out


def _abs_max(t: Any) -> float:
    """max|t| in one pass over `t` (`torch.aminmax`, which propagates NaN
    and Inf: nan or inf then); 0 for an empty tensor."""
    import torch

    if not t.numel():
        return 0.0
    if not t.is_floating_point():  # a header may declare integer weights
        t = t.to(torch.float64)
    lo, hi = (float(v) for v in torch.aminmax(t))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


# IEEE floats read by their bits (safetensors name -> unsigned integer type,
# the bits of +Inf): with the sign bit cleared, non-negative floats order as
# their bits do, and bits above +Inf's are NaN.
_FLOAT_BITS = {"BF16": ("uint16", 0x7F80), "F16": ("uint16", 0x7C00), "F32": ("uint32", 0x7F800000)}


def abs_max_bits(buf: Any, dtype: str) -> float:
    """max|value| of the `dtype` values (a `_FLOAT_BITS` name) in the bytes
    `buf` (a buffer of whole values): nan if one is NaN, else inf if one is
    Inf; 0 if empty. From the bits, without torch, so the host tier's reader
    processes run it too (worker/reader_proc.py): two reductions in numpy,
    each one pass that releases the GIL once. Read as unsigned, a negative
    value's bits are the sign bit plus its magnitude's, above every positive
    value's: the largest is the sign bit plus the largest negative magnitude,
    if any value is negative. Read as signed, the largest is the largest
    positive magnitude, if any value is positive (else it is negative)."""
    import numpy as np

    kind, inf = _FLOAT_BITS[dtype]
    unsigned = np.frombuffer(buf, dtype=kind)
    if not unsigned.size:
        return 0.0
    sign = 1 << (8 * unsigned.itemsize - 1)
    top_unsigned = int(unsigned.max())
    top_signed = int(unsigned.view(kind.replace("u", "")).max())
    top = max(top_signed, top_unsigned - sign, 0)
    if top > inf:
        return math.nan
    if top == inf:
        return math.inf
    if dtype == "BF16":  # the upper half of a float32
        return float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([top], dtype=kind).view(np.float16 if dtype == "F16"
                                                  else np.float32)[0])


def check_weight_values(spec: PeftSpec, tensors: Iterable[tuple[str, Any, bool]],
                        max_value: float, parts: Executor | None = None,
                        part_bytes: int = PART_BYTES) -> None:
    """Raise BadWeights naming the first tensor that holds NaN or Inf, or
    saying that the adapter's scaling overflows the serving dtype, whose
    largest finite value is `max_value` (`torch.finfo(dtype).max`): the pool
    folds the scaling into B (paging/layout.py `pack_layers`, vLLM's
    `LoRALayerWeights.optimize` likewise), so scaling * max|B| must be finite
    in that dtype, and so must the scaling itself.

    `tensors`: (how a message names it, the tensor, whether it is a B
    weight). One pass over each tensor's memory (benchmarks/cold_start/
    check_rate.py measures it); with `parts`, in groups of at least
    `part_bytes` (`_groups`) on that executor."""
    scale = f"scaling {spec.scaling:.4g} (lora_alpha {spec.alpha:.4g} / " + \
        (f"sqrt(r={spec.rank}), rsLoRA)" if spec.use_rslora else f"r={spec.rank})")
    if spec.scaling > max_value:
        raise BadWeights(f"{scale} is above {max_value:.4g}, the largest value of the "
                         "serving dtype")
    tensors = list(tensors)
    groups = _groups([t.numel() * t.element_size() for _, t, _ in tensors],
                     part_bytes if parts is not None else math.inf)
    maxima = map_all(parts, lambda g: [_abs_max(tensors[i][1]) for i in g], groups)
    max_b = 0.0
    for (name, _, is_b), m in zip(tensors, (m for ms in maxima for m in ms), strict=True):
        if not math.isfinite(m):
            raise BadWeights(f"tensor {name} holds non-finite values (NaN or Inf)")
        if is_b:
            max_b = max(max_b, m)
    if spec.scaling * max_b > max_value:
        raise BadWeights(f"{scale} times the largest |lora_B| weight {max_b:.4g} is "
                         f"{spec.scaling * max_b:.4g}, above {max_value:.4g}, the largest "
                         "value of the serving dtype: lora_alpha is too large")


def check_finite_weights(spec: PeftSpec, max_value: float) -> None:
    """`check_weight_values` over the adapter's files: reads every tensor
    (unlike `inspect_adapter`), so callers run it off the event loop, once
    per adapter version. The paged pool checks the bytes its reader keeps
    instead (`read_weights`' `max_value`)."""
    check_weight_values(spec, ((repr(key), t, _KINDS.get(_split_key(key)[1]) == "B")
                               for key, t in _read_tensors(spec.path).items()), max_value)


def inspect_adapter(path: str) -> PeftSpec:
    """Read and check an adapter directory's config and tensor shapes.

    Raises AdapterError for anything vLLM would reject or serve wrongly: a
    missing or malformed config, unreadable weights, unsupported features,
    A/B pairs that do not match each other or the configured rank.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise AdapterError(f"adapter directory {path} does not exist")
    cfg = _read_config(path)
    rank, alpha, use_rslora = _check_config(cfg)
    shapes, size = _tensor_shapes(path)
    if not shapes:
        raise AdapterError(f"the adapter weights in {path} hold no tensors")

    pairs: dict[str, dict[str, list[int]]] = {}
    embedding: set[str] = set()
    for key, (shape, _) in shapes.items():
        module, kind = _split_key(key)
        if kind not in _KINDS or not module:
            raise AdapterError(f"unexpected tensor {key!r}: not a LoRA A/B weight")
        if len(shape) != 2:
            raise AdapterError(f"tensor {key!r} has shape {shape}; LoRA weights are 2-D")
        pairs.setdefault(module, {})[_KINDS[kind]] = shape
        if kind.startswith("lora_embedding"):
            embedding.add(module)

    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"module {module} has no {missing} weight")
        (ra, n_in), (n_out, rb) = ab["A"], ab["B"]
        if ra != rb:
            raise AdapterError(f"module {module}: lora_A has rank {ra} but lora_B has rank {rb}")
        if ra != rank:
            raise AdapterError(
                f"module {module} has rank {ra} but adapter_config.json says r={rank}"
            )
        modules[module] = ModuleShape(ra, n_in, n_out, module in embedding)

    return PeftSpec(
        path=path,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        base_model=cfg.get("base_model_name_or_path"),
        size_bytes=size,
        modules=modules,
    )


def load_adapter(path: str) -> tuple[PeftSpec, dict[str, tuple[Any, Any]]]:
    """An adapter's spec (checked as `inspect_adapter` does) and its weights:
    module path (PEFT prefix stripped) -> (A [rank, in], B [out, rank]), CPU
    tensors in the file's dtype, scaling not applied."""
    spec = inspect_adapter(path)
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in _read_tensors(spec.path).items():
        module, kind = _split_key(key)
        pairs.setdefault(module, {})[_KINDS.get(kind, kind)] = tensor
    if pairs.keys() != spec.modules.keys() or any(set(ab) != {"A", "B"}
                                                   for ab in pairs.values()):
        raise AdapterError(f"the adapter weights in {spec.path} changed while being read")
    return spec, {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}


@dataclass(frozen=True)
class RawTensor:
    """Where one weight lies in `RawWeights.data`."""

    offset: int  # bytes
    shape: tuple[int, ...]
    dtype: Any  # torch dtype


@dataclass(frozen=True)
class RawWeights:
    """An adapter's tensors as one byte buffer, as the weights file holds
    them (file dtype, B not transposed, scaling not applied), and where each
    A and B lies in it. Whoever holds the buffer decides where the packing
    into pages runs (worker/paged_manager.py: on the GPU)."""

    data: Any  # uint8 tensor
    modules: Mapping[str, tuple[RawTensor, RawTensor]]  # module path -> (A, B)

    def tensors(self, data: Any = None, names: Any = None) -> dict[str, tuple[Any, Any]]:
        """Module path -> (A, B), views of `data` (default: this buffer, or a
        copy of it on another device), of the modules `names` (default: all)."""
        data = self.data if data is None else data
        names = self.modules if names is None else names
        return {m: tuple(_view(data, t) for t in self.modules[m]) for m in names}


def _view(data: Any, t: RawTensor) -> Any:
    n = math.prod(t.shape) * t.dtype.itemsize
    chunk = data[t.offset:t.offset + n]
    if t.offset % t.dtype.itemsize:  # the format does not promise alignment
        chunk = chunk.clone()
    return chunk.view(t.dtype).view(t.shape)


def _safetensors_index(st_path: str, path: str
                       ) -> tuple[int, int, dict[str, tuple[int, list[int], str]]]:
    """(data start, data size, key -> (offset, shape, dtype)) from the
    file's header: an 8-byte little-endian length, then that much JSON. Each
    entry is checked (the file may have changed since it was inspected): its
    bytes match its shape and lie in the data."""
    what = f"{SAFETENSORS_FILE} in {path}"
    with open(st_path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if file_size < 8 or n > min(MAX_HEADER_BYTES, file_size - 8):
            raise AdapterError(f"{what} is unreadable: its header length {n} does not fit "
                               f"the file ({file_size} bytes; at most {MAX_HEADER_BYTES})")
        header = _parse_json(f.read(n), f"the header of {what}")
    if not isinstance(header, dict):
        raise AdapterError(f"{what} is unreadable: its header is not a JSON object")
    size = file_size - 8 - n
    index = {}
    for key, v in header.items():
        if key == "__metadata__":
            continue
        entry = v if isinstance(v, dict) else {}
        dt, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (dt in _DTYPE_BYTES and isinstance(shape, list) and isinstance(offsets, list)
                and len(offsets) == 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in [*shape, *offsets])
                and offsets[0] + math.prod(shape) * _DTYPE_BYTES[dt] == offsets[1]):
            raise AdapterError(f"{what} is unreadable: the header's entry for {_show(key)} "
                               f"is not a tensor: {_show(v)}")
        if offsets[1] > size:  # inspect_adapter's read of the header found it in the data
            raise AdapterError(f"the adapter weights in {path} changed while being read")
        index[key] = (offsets[0], shape, dt)
    return 8 + n, size, index


def read_weights(path: str, alloc: Any, max_value: float | None = None,
                 parts: Executor | None = None, part_bytes: int = PART_BYTES,
                 files: SpanFiles | None = None, pause: Callable[[], None] | None = None
                 ) -> tuple[PeftSpec, RawWeights]:
    """An adapter's spec (checked as `inspect_adapter` does) and its tensors
    in one buffer that `alloc(nbytes)` returns (a uint8 tensor, e.g. pinned).
    A safetensors file's data goes in with positional reads; an
    adapter_model.bin is loaded, then copied in. With `max_value`, the
    values are checked too (`check_weight_values`), in that buffer: the files
    are read once. A safetensors file's values are screened as each piece is
    read (`read_span`), and checked tensor by tensor only where the screen
    finds them wrong or cannot judge them (`_fits`; an adapter_model.bin
    always). With `parts`, the read and the check are split into pieces of
    about `part_bytes`, run by this thread and tasks on `parts`
    (`map_all`): one thread reads and checks at ~1.4-1.8 GB/s (an H200
    host's /dev/shm, docs/benchmarks/cold-start.md), well below the
    memory's rate. With `files`, the file is read and screened in those
    pieces by `files.read_spans`, in one request (the host tier's reader
    processes, where `alloc` returns memory they map), and `parts` is not
    used. `pause` is called where the read may wait for the engine thread
    (worker/read_gate.py): before its metadata work, before each piece it
    reads in this process, and after a reader process's answer."""
    import torch

    pause = pause or _no_pause
    dtypes = {st: getattr(torch, t) for st, t in _WEIGHT_DTYPES.items()}
    pause()
    spec = inspect_adapter(path)
    st_path = os.path.join(spec.path, SAFETENSORS_FILE)
    refs: dict[str, dict[str, RawTensor]] = {}
    maxima = None  # each piece's max|value|, where the read screened them
    if os.path.isfile(st_path):
        try:
            start, size, index = _safetensors_index(st_path, spec.path)
            data = alloc(size)
            # The values are screened as they are read when the file's
            # tensors share one float dtype (`_fits`).
            file_dtypes = {dt for _, _, dt in index.values()}
            screen = file_dtypes.pop() if max_value is not None and len(file_dtypes) == 1 \
                else None
            if screen not in _FLOAT_BITS or size % _DTYPE_BYTES[screen] or any(
                    off % _DTYPE_BYTES[screen] for off, _, _ in index.values()):
                screen = None  # values off the dtype's grid: tensor by tensor
            spans = _spans(size, part_bytes if parts is not None or files is not None
                           else size, _DTYPE_BYTES[screen] if screen else 1)
            if files is not None:  # one request: the reader splits it over its own threads
                results = files.read_spans(st_path, start, data, spans, screen)
                pause()
            else:
                results = read_file_spans(st_path, start, memoryview(data.numpy()), spans,
                                          screen, parts, pause)
        except OSError as e:  # its cause tells a transient error (worker/host_tier.py)
            raise AdapterError(f"{SAFETENSORS_FILE} in {spec.path} is unreadable: {e}") from e
        if sum(got for got, _ in results) != size:
            raise AdapterError(f"the adapter weights in {spec.path} changed while being read")
        if screen:
            maxima = [m for _, m in results]
        for key, (offset, shape, dt) in index.items():
            if dt not in dtypes:  # the file changed since its inspection
                raise AdapterError(f"tensor {key!r} has dtype {dt}; LoRA weights must be "
                                   f"one of {list(WEIGHT_DTYPES)}")
            module, kind = _split_key(key)
            refs.setdefault(module, {})[_KINDS.get(kind, kind)] = RawTensor(
                offset, tuple(shape), dtypes[dt])
    else:
        tensors = _read_tensors(spec.path)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        data, offset = alloc(size), 0
        for key, t in tensors.items():
            n = t.numel() * t.element_size()
            data[offset:offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            module, kind = _split_key(key)
            refs.setdefault(module, {})[_KINDS.get(kind, kind)] = RawTensor(
                offset, tuple(t.shape), t.dtype)
            offset += n
    modules = {m: (ab["A"], ab["B"]) for m, ab in refs.items() if set(ab) == {"A", "B"}}
    if modules.keys() != spec.modules.keys() or any(
            (a.shape, b.shape) != ((s.rank, s.in_features), (s.out_features, s.rank))
            for m, s in spec.modules.items() for a, b in [modules[m]]):
        raise AdapterError(f"the adapter weights in {spec.path} changed while being read")
    raw = RawWeights(data, modules)
    if max_value is not None:
        if not _fits(spec, maxima, max_value):
            # The tensor by tensor check names what is wrong, and tells large
            # A values (fine: the scaling goes into B only) from large B ones.
            check_weight_values(spec, [(f"lora_{kind} of {m}", t, kind == "B")
                                       for m, ab in raw.tensors().items()
                                       for kind, t in zip("AB", ab, strict=True)], max_value,
                                parts, part_bytes)
    return spec, raw


def _fits(spec: PeftSpec, maxima: list[float] | None, max_value: float) -> bool:
    """Whether the read's screen (`maxima`: max|value| of each piece of the
    file's data; None: not screened) shows the values pass
    `check_weight_values`: every value finite and scaling * max|value|
    within `max_value` (the largest B is no larger). False means "check
    tensor by tensor", not "bad". A screen takes a few passes where the
    tensors take hundreds of calls (448 for Llama-3-8B all-linear), each of
    which would take the reader's GIL twice (benchmarks/e2e/load_host_time.py)."""
    return maxima is not None and spec.scaling <= max_value and \
        all(math.isfinite(m) for m in maxima) and spec.scaling * max(maxima) <= max_value


class SpanFiles(Protocol):
    """Reads files into memory it maps (worker/file_readers.py: the host
    tier's reader processes)."""

    def read_spans(self, path: str, start: int, dest: Any, spans: list[tuple[int, int]],
                   screen: str | None) -> list[tuple[int, float | None]]:
        """`read_span` of file `path` into `dest` (a uint8 tensor in memory
        the reader maps) for each of `spans`, in any order and at once; a
        span's error is raised once none of them still writes into `dest`."""


def read_span(fd: int, view: memoryview, start: int, lo: int, hi: int, screen: str | None
              ) -> tuple[int, float | None]:
    """The file's bytes [start + lo, start + hi) into view[lo:hi]: how many
    it held, and with `screen` (a `_FLOAT_BITS` dtype) their max|value|
    (`abs_max_bits`; None without), while they are in the cache."""
    got = _pread_into(fd, view, start, lo, hi)  # short: the caller finds the file changed
    return got, abs_max_bits(view[lo:hi], screen) if screen and got == hi - lo else None


def read_file_spans(path: str, start: int, view: memoryview, spans: list[tuple[int, int]],
                    screen: str | None, parts: Executor | None,
                    pause: Callable[[], None] | None = None) -> list[tuple[int, float | None]]:
    """`read_span` of file `path` into `view` for each of `spans`, split
    over `parts` (`map_all`), each after `pause()`: the read of this
    process's threads, and of a reader process (worker/reader_proc.py)."""
    pause = pause or _no_pause
    fd = os.open(path, os.O_RDONLY)
    try:
        return map_all(parts, lambda s: (pause(), read_span(fd, view, start, *s, screen))[1],
                       spans)
    finally:
        os.close(fd)


def _no_pause() -> None:
    pass


def map_all(parts: Executor | None, fn: Any, items: list) -> list:
    """[fn(x) for x in items]. With `parts`, this thread and tasks on
    `parts` take the items in turn: the call goes on on its own thread even
    when every task of `parts` is busy (other reads, a hung file), and tasks
    not started when the items run out are cancelled. Every task has ended
    before this returns or raises (an item's error; after one, no item
    starts): none may still use a file or a buffer its caller closes or
    frees."""
    if parts is None or len(items) < 2:
        return [fn(x) for x in items]
    results: list = [None] * len(items)
    errors: dict[int, Exception] = {}
    lock = threading.Lock()
    taken = 0

    def work() -> None:
        nonlocal taken
        while True:
            with lock:
                if taken >= len(items):
                    return
                i, taken = taken, taken + 1
            try:
                results[i] = fn(items[i])
            except Exception as e:
                with lock:
                    errors[i], taken = e, len(items)

    helpers: list[Future] = []
    try:
        for _ in range(len(items) - 1):
            helpers.append(parts.submit(work))
        work()
    finally:
        with lock:
            taken = len(items)  # e.g. submit raised: no task starts another item
        # A cancelled task never runs, but wait() counts it done only once a
        # busy executor has dequeued it: wait for the others alone.
        wait([f for f in helpers if not f.cancel()])
    if errors:
        raise errors[min(errors)]
    return results


def _spans(size: int, part_bytes: int, align: int = 1) -> list[tuple[int, int]]:
    """[0, size) in pieces of about `part_bytes` (at least one, at most
    1024), each starting at a multiple of `align`."""
    n = max(1, min(-(-size // max(part_bytes, 1)), 1024))
    edges = [size * i // n // align * align for i in range(n)] + [size]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _pread_into(fd: int, view: memoryview, start: int, lo: int, hi: int) -> int:
    """The file's bytes [start + lo, start + hi) into view[lo:hi]; how many
    it held (fewer: the file is shorter than its header says)."""
    got = lo
    while got < hi and (n := os.preadv(fd, [view[got:hi]], start + got)):
        got += n
    return got - lo


@dataclass(frozen=True)
class ModelLoRAInfo:
    """What the served model accepts: short module name -> allowed (in, out)
    pairs (one per distinct layer shape), the rank limit, and every module
    path an adapter may name (PEFT's names, e.g.
    `model.layers.0.self_attn.q_proj`; None where only the shapes are known:
    the pool's own check in the scheduler, whose worker checks paths on read)."""

    shapes: Mapping[str, frozenset[tuple[int, int]]]
    max_rank: int
    modules: frozenset[str] | None = None

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any], max_rank: int) -> ModelLoRAInfo:
        """From the workers' `loraserve_lora_modules` (worker/residency.py)."""
        modules = raw["modules"]
        return cls({k: frozenset(tuple(p) for p in v) for k, v in raw["shapes"].items()},
                   max_rank, None if modules is None else frozenset(modules))

    def to_wire(self) -> dict[str, Any]:
        return {"max_rank": self.max_rank,
                "shapes": {k: sorted(v) for k, v in sorted(self.shapes.items())},
                "modules": None if self.modules is None else sorted(self.modules)}


def check_against_model(spec: PeftSpec, model: ModelLoRAInfo) -> None:
    """Raise AdapterError if the served model cannot apply this adapter: its
    rank, its modules by name (layer index included) and their shapes."""
    if spec.rank > model.max_rank:
        raise AdapterError(
            f"rank {spec.rank} is above this server's maximum LoRA rank {model.max_rank} "
            "(--max-lora-rank)"
        )
    unsupported = sorted(set(spec.target_modules) - set(model.shapes))
    if unsupported:
        raise AdapterError(
            f"unsupported target module(s) {unsupported}; this model applies LoRA to "
            f"{sorted(model.shapes)}"
        )
    if model.modules is not None:
        unknown = sorted(set(spec.modules) - model.modules)
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise AdapterError(
                f"adapter does not fit this base model: it targets {unknown[0]}{more}, which "
                f"this model does not have (adapter trained for "
                f"{spec.base_model or 'an unknown base model'})")
    for module, m in spec.modules.items():
        allowed = model.shapes[short_name(module)]
        if (m.in_features, m.out_features) not in allowed:
            want = " or ".join(f"in={i}, out={o}" for i, o in sorted(allowed))
            raise AdapterError(
                f"adapter does not fit this base model: {module} has in={m.in_features}, "
                f"out={m.out_features} but the model's {short_name(module)} has {want} "
                f"(adapter trained for {spec.base_model or 'an unknown base model'})"
            )


def write_adapter(
    path: str,
    weights: Mapping[str, tuple[Any, Any]],
    *,
    rank: int,
    alpha: float,
    base_model: str,
    use_rslora: bool = False,
    embeddings: Collection[str] = (),
) -> None:
    """Write a PEFT LoRA adapter directory.

    `weights` maps a full module path (e.g. `model.layers.0.self_attn.q_proj`)
    to (A [rank, in], B [out, rank]) torch tensors; modules named in
    `embeddings` are written as embedding LoRA (A [rank, vocab], B [dim, rank]).
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for module, (a, b) in weights.items():
        if module in embeddings:  # PEFT keeps these as bare parameters
            names = (f"{_PREFIX}{module}.lora_embedding_A", f"{_PREFIX}{module}.lora_embedding_B")
        else:
            names = (f"{_PREFIX}{module}.lora_A.weight", f"{_PREFIX}{module}.lora_B.weight")
        tensors[names[0]], tensors[names[1]] = a.contiguous(), b.contiguous()
    targets = sorted({short_name(m) for m in weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    save_file(tensors, os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
