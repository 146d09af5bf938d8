"""The control segment: what the engine and its CPU workers tell each other.

One definition for both sides (pool.py writes jobs, proc.py carries them out).
The segment holds, in order:

- `flags` (int64): SHUTDOWN; TIMED_OUT (a device wait that gave up stores its
  job here); one READY flag per descriptor slot (the job whose input rows are
  in place: set by the engine, or by the GPU's copy_to_host_and_flag; a job
  waits on the READY flag of its descriptor's `ready_job`, so a batch of
  jobs over the same rows is published by one flag); one DONE and one ERROR
  flag per worker (the last job it finished / failed); one FAILED flag per
  descriptor slot (the slot's last job that some worker failed, so each
  job's failure is known, not only a worker's last one).
  Job ids start at 1 and grow by one; a flag holds a job id, so waits are
  `flag >= job`. Only one side ever writes a given flag (FAILED: the
  workers, each storing the same job id).
- `speeds` (float64, one per worker): rows/s of the start-up profile GEMM;
  0 until the worker has started.
- `jobs`: a ring of `depth` job descriptors (`descriptor_dtype`), slot
  `job % depth`; the engine writes a slot only once every worker is done
  with the job that held it before.
- `messages`: MESSAGE_BYTES per worker, the error text of its last failure.

Memory order: each side writes its data (descriptor, rows, results) before
the flag that publishes it. Aligned 8-byte stores are single stores on the
machines vLLM serves from (x86-64, whose stores are seen in program order;
the GPU's stores come over PCIe in order), and a semaphore post between a
descriptor and its worker is a full barrier.

Weights and rows are located by (segment, byte offset, strides, dtype):
segment 0 is the pool's io segment (rows in, results out, staging for
weights that live elsewhere), segment i > 0 the i-th weight segment the
workers mapped at start-up (the host tier's arena chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SHUTDOWN, TIMED_OUT = 0, 1
MESSAGE_BYTES = 512
_HEAD = 2

# Stable codes for the dtypes a descriptor may name.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


def _tensor_fields(name: str) -> list[tuple[str, type]]:
    return [(f"{name}_{f}", np.int64) for f in ("seg", "off", "s0", "s1", "dtype")]


def descriptor_dtype(workers: int) -> np.dtype:
    """One job: y[rows, out] = ((x[rows, in] @ a.T) * scaling) @ bt, each
    worker taking its `rows` range (start, end) of the job's `n` rows; x
    ([n, in], contiguous) and y ([n, out], contiguous) lie in the io segment
    at byte offsets `x_off` and `y_off`."""
    return np.dtype(
        [("job", np.int64), ("ready_job", np.int64), ("n", np.int64),
         ("in_features", np.int64), ("out_features", np.int64), ("rank", np.int64),
         ("x_dtype", np.int64), ("y_dtype", np.int64), ("x_off", np.int64),
         ("y_off", np.int64), ("notify", np.int64),
         ("scaling", np.float64)]
        + _tensor_fields("a") + _tensor_fields("bt")
        + [("rows", np.int64, (workers, 2))],
        align=True)


@dataclass(frozen=True)
class ControlLayout:
    workers: int
    depth: int

    @property
    def ready0(self) -> int:
        return _HEAD

    @property
    def done0(self) -> int:
        return _HEAD + self.depth

    @property
    def error0(self) -> int:
        return self.done0 + self.workers

    @property
    def failed0(self) -> int:
        return self.error0 + self.workers

    @property
    def num_flags(self) -> int:
        return self.failed0 + self.depth

    def _offsets(self) -> tuple[int, int, int, int]:
        speeds = 8 * self.num_flags
        jobs = speeds + 8 * self.workers
        jobs += -jobs % 64
        messages = jobs + descriptor_dtype(self.workers).itemsize * self.depth
        return speeds, jobs, messages, messages + MESSAGE_BYTES * self.workers

    @property
    def nbytes(self) -> int:
        return self._offsets()[3]


class Control:
    """Views of a control segment's bytes (a uint8 tensor of layout.nbytes)."""

    def __init__(self, layout: ControlLayout, raw: torch.Tensor) -> None:
        speeds, jobs, messages, end = layout._offsets()
        if raw.numel() < end:
            raise ValueError(f"a control segment of {raw.numel()} bytes; {end} needed")
        self.layout = layout
        self.flags_tensor = raw[:speeds].view(torch.int64)  # what the CUDA op reads and writes
        self.flags = self.flags_tensor.numpy()
        self.speeds = raw[speeds:speeds + 8 * layout.workers].view(torch.float64).numpy()
        self.jobs = raw[jobs:messages].numpy().view(descriptor_dtype(layout.workers))
        self.messages = raw[messages:end].numpy().reshape(layout.workers, MESSAGE_BYTES)

    def ready_index(self, job: int) -> int:
        return self.layout.ready0 + job % self.layout.depth

    def done(self) -> np.ndarray:
        lay = self.layout
        return self.flags[lay.done0:lay.done0 + lay.workers]

    def failed_index(self, job: int) -> int:
        return self.layout.failed0 + job % self.layout.depth

    def errors(self) -> np.ndarray:
        lay = self.layout
        return self.flags[lay.error0:lay.error0 + lay.workers]

    def set_message(self, worker: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[:MESSAGE_BYTES - 1]
        row = self.messages[worker]
        row[:] = 0
        row[:len(data)] = np.frombuffer(data, dtype=np.uint8)

    def message(self, worker: int) -> str:
        row = bytes(self.messages[worker])
        return row.split(b"\0", 1)[0].decode("utf-8", "replace")


def strided(raw: torch.Tensor, offset: int, shape: tuple[int, int], strides: tuple[int, int],
            dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape`, `strides` (elements) and `dtype` whose first
    element sits `offset` bytes into `raw` (uint8); raises if it would reach
    outside `raw`."""
    item = torch.empty((), dtype=dtype).element_size()
    if offset % item or min(strides) < 0:
        raise ValueError(f"offset {offset} / strides {strides} do not fit {dtype}")
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if offset + span * item > raw.numel():
        raise ValueError(f"a {shape} {dtype} tensor at byte {offset} (strides {strides}) "
                         f"reaches past {raw.numel()} bytes")
    base = raw[offset:offset + max(span, 1) * item].view(dtype)
    return base.as_strided(shape, strides)
