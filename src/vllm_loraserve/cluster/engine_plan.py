"""Where each cluster engine runs: its device, environment, `vllm serve`
command line and port, decided before any process starts (`plan_engines`, a
pure function: tests/cluster/test_engine_plan.py checks it for 1, 2 and 4
GPUs without one).

On CUDA, engine i runs on GPU `gpus[i // engines_per_gpu]`, seen by its
server as its only device (`CUDA_VISIBLE_DEVICES`). Engines sharing a GPU
split `--gpu-memory-utilization` evenly: vLLM reads the flag as this
instance's share of the whole GPU, so K engines at util/K together use at
most util. Engines sharing a GPU start one after another (`start_waves`):
vLLM's startup memory profile assumes no other process changes the GPU's
usage meanwhile (vllm/v1/worker/gpu_worker.py, "Error in memory profiling").

Invariants: every engine binds 127.0.0.1; on CUDA no GPU holds more than
`engines_per_gpu` engines and the shares on one GPU sum to the requested
utilization; on CPU the plan is the launcher's earlier one (a core per
engine, no device flags).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ENGINE_HOST = "127.0.0.1"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default
UTIL_FLAG = "--gpu-memory-utilization"


class PlanError(ValueError):
    """An engine layout that cannot run; the message says what to change."""


@dataclass(frozen=True)
class EnginePlan:
    index: int
    workdir: str  # logs and the engine's adapter store (`workdir/adapters`)
    device: str  # "cpu" or "cuda"
    gpu: str | None  # the CUDA device id the engine sees as its only one; None on CPU
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the launcher's env
    args: tuple[str, ...] = ()  # `vllm serve` arguments after the model, without the port
    port: int = 0  # 0: a free port picked at each start
    host: str = ENGINE_HOST

    @property
    def store_root(self) -> str:
        return os.path.join(self.workdir, "adapters")

    def command(self, executable: str, model: str, port: int) -> list[str]:
        # The router loads adapters from this engine's store only.
        return [executable, "serve", model, "--plugin", "loraserve", "--enable-lora",
                "--host", self.host, "--port", str(port),
                "--loraserve-allowed-root", self.store_root, *self.args]


def plan_engines(engines: int, device: str, workdir: str, serve_args: Sequence[str] = (), *,
                 gpus: Sequence[str] = (), engines_per_gpu: int = 1,
                 gpu_memory_utilization: float | None = None, cpu_cores: int = 1,
                 base_port: int = 0, kv_cache_gib: str = "1",
                 gpu_bytes: int | None = None, model_bytes: int | None = None,
                 ) -> list[EnginePlan]:
    """The plan for `engines` engines under `workdir/engine-<i>`.

    `gpus`: the CUDA device ids visible to the launcher (its
    CUDA_VISIBLE_DEVICES, else 0..count-1). `gpu_bytes` and `model_bytes`
    (a GPU's memory, the model's weights), when known, refuse a share
    that cannot hold the weights. `base_port` > 0 gives engine i port
    base_port + i."""
    if engines < 1:
        raise PlanError(f"--engines must be at least 1, not {engines}")
    if base_port < 0 or base_port + engines - 1 > 65535:
        raise PlanError(f"--engine-base-port {base_port} leaves no valid port for "
                        f"{engines} engines")
    ports = [base_port + i if base_port else 0 for i in range(engines)]
    dirs = [os.path.join(workdir, f"engine-{i}") for i in range(engines)]
    if device == "cpu":
        if engines_per_gpu != 1 or gpu_memory_utilization is not None:
            raise PlanError("--engines-per-gpu and --gpu-memory-utilization apply to "
                            "--device cuda only")
        return [EnginePlan(i, dirs[i], "cpu", None,
                           {"VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, cpu_cores)),
                            "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib},
                           tuple(serve_args), ports[i]) for i in range(engines)]
    if device != "cuda":
        raise PlanError(f"unknown device {device!r}; use cpu or cuda")
    share = gpu_share(engines, gpus, engines_per_gpu, gpu_memory_utilization, serve_args,
                      gpu_bytes, model_bytes)
    args = (*serve_args, UTIL_FLAG, f"{share:.4f}")
    return [EnginePlan(i, dirs[i], "cuda", gpus[i // engines_per_gpu],
                       {"CUDA_VISIBLE_DEVICES": gpus[i // engines_per_gpu]}, args, ports[i])
            for i in range(engines)]


def gpu_share(engines: int, gpus: Sequence[str], engines_per_gpu: int,
              gpu_memory_utilization: float | None, serve_args: Sequence[str],
              gpu_bytes: int | None, model_bytes: int | None) -> float:
    """Each engine's `--gpu-memory-utilization`, or PlanError saying why none fits."""
    if any(a == UTIL_FLAG or a.startswith(UTIL_FLAG + "=") for a in serve_args):
        raise PlanError(f"pass {UTIL_FLAG} to `cluster up` itself, not in --serve-args: "
                        "it is split between the engines sharing a GPU")
    if not gpus:
        raise PlanError("--device cuda, but no CUDA device is visible")
    if engines_per_gpu < 1:
        raise PlanError(f"--engines-per-gpu must be at least 1, not {engines_per_gpu}")
    needed = math.ceil(engines / engines_per_gpu)
    if needed > len(gpus):
        raise PlanError(
            f"{engines} engines at {engines_per_gpu} per GPU need {needed} GPUs, but "
            f"{len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible: pass "
            f"--engines-per-gpu {math.ceil(engines / len(gpus))} or "
            f"--engines {len(gpus) * engines_per_gpu}")
    util = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None \
        else gpu_memory_utilization
    if not 0 < util <= 1:
        raise PlanError(f"{UTIL_FLAG} must be in (0, 1], not {util}")
    share = util / engines_per_gpu
    if gpu_bytes and model_bytes and share * gpu_bytes <= model_bytes:
        raise PlanError(
            f"{engines_per_gpu} engines per GPU at {UTIL_FLAG} {util} give each "
            f"{share * gpu_bytes / 2**30:.1f} GiB, not enough for the model's "
            f"{model_bytes / 2**30:.1f} GiB of weights and a KV cache: use fewer engines "
            f"per GPU or a higher {UTIL_FLAG}")
    return share


def start_waves(plans: Sequence[EnginePlan]) -> list[list[int]]:
    """Engine indices in start order: wave w holds the w-th engine of every
    GPU (all CPU engines in one wave), so no two engines on one GPU start
    together and different GPUs start in parallel."""
    on_gpu: dict[str, int] = {}
    waves: list[list[int]] = []
    for p in plans:
        w = 0
        if p.gpu is not None:
            w = on_gpu[p.gpu] = on_gpu.get(p.gpu, -1) + 1
        while len(waves) <= w:
            waves.append([])
        waves[w].append(p.index)
    return waves


def visible_gpus(env: Mapping[str, str], count: int) -> list[str]:
    """The CUDA device ids this process may hand out: its own
    CUDA_VISIBLE_DEVICES (ids or UUIDs, kept as written), else 0..count-1."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:count]
