"""`loraserve cluster up`: Ray on loopback, N engines, the router.

Ray's components bind the machine's routable address by default, even when
asked for 127.0.0.1 (`resolve_ip_for_localhost` replaces it). Ray's
single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the mode it uses
on macOS and Windows) keeps every component on loopback; `start_ray` sets it
before Ray is imported and refuses to go on if Ray was imported earlier.

Each engine is a Ray actor owning one `vllm serve --plugin loraserve`
process (cluster/engine.py); the router actor owns the state
(cluster/router.py) and serves the HTTP API (cluster/http/) with uvicorn
on its own event loop, so routing needs no extra hop. Stopping stops the
router, then every engine server by its PID, then Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, field

from vllm_loraserve.cluster.engine import Engine, EngineSpec
from vllm_loraserve.cluster.engine_plan import EnginePlan, plan_engines, start_waves, visible_gpus
from vllm_loraserve.worker.rendezvous import _is_loopback

logger = logging.getLogger(f"vllm.{__name__}")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
ADMIN_TOKEN_ENV = "LORASERVE_ADMIN_TOKEN"
NAMESPACE = "loraserve"
SUPPORTED_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


@dataclass(frozen=True)
class ClusterSpec:
    engines: int
    model: str  # path or name given to every `vllm serve`
    adapters: str  # directory of PEFT adapter directories (the source engines fetch from)
    served_model_name: str | None = None  # the base model's API name (default: `model`)
    policy: str = "loraserve"  # a placement policy name (cluster/placement)
    host: str = "127.0.0.1"  # the router's address; engines always bind 127.0.0.1
    port: int = 8000
    rebalance_s: float | None = 30.0  # None: place at start and on faults only
    health_interval_s: float = 2.0
    restart_attempts: int = 3  # restarts of a dead engine before it is left down
    transport: str = "tcp"  # adapter transport between engines (cluster/transport)
    workdir: str = ".loraserve-cluster"  # logs, engine stores, registered adapters
    serve_args: tuple[str, ...] = ()  # extra `vllm serve` arguments for every engine
    device: str = "auto"  # "cpu", "cuda" or "auto"
    engines_per_gpu: int = 1  # CUDA: engines sharing one GPU (engine_plan.py)
    gpu_memory_utilization: float | None = None  # CUDA: per GPU, split between its engines
    engine_base_port: int = 0  # engine i listens on base + i; 0: free ports
    profile: str | None = None  # `loraserve profile` output; default: the built-in model
    # Bearer token every /admin route requires; needed when `host` is not loopback.
    admin_token: str | None = field(default=None, repr=False)
    # Directories `POST /admin/adapters` may read from, besides `adapters`.
    allowed_roots: tuple[str, ...] = ()

    @property
    def base_model(self) -> str:
        return self.served_model_name or self.model


def check_exposure(spec: ClusterSpec) -> None:
    """Refuse to expose the router beyond loopback without an admin token:
    its /admin routes copy files, load adapters and restart engines."""
    if not _is_loopback(spec.host) and not spec.admin_token:
        raise ValueError(
            f"refusing to serve the router on --host {spec.host}, which is not a loopback "
            f"address, without an admin token: pass --admin-token or set {ADMIN_TOKEN_ENV}")


def start_ray(num_cpus: int) -> None:
    os.environ[LOOPBACK_ENV] = "0"
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"Ray was imported before {LOOPBACK_ENV}=0 was set, so it would "
                           "bind non-loopback addresses: start the cluster in a fresh process")
    if not ray.is_initialized():
        # log_to_driver: the router's events (engine down, restarts, refused
        # adapters) reach the terminal; engine servers log to their own files.
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                 namespace=NAMESPACE)


class RayEngineHandle:
    """`EngineHandle` over an engine actor. An engine method's exception is
    raised as itself (not Ray's wrapper with the remote traceback), so the
    router and its HTTP errors see e.g. `AdapterRejected` and its reason."""

    def __init__(self, actor, info: dict) -> None:
        self.actor = actor
        self._set(info)

    def _set(self, info: dict) -> None:
        self.index, self.url = info["index"], info["url"]
        self.transport_address, self.pid = info["transport_address"], info["pid"]

    async def _call(self, method: str, *args):
        from ray.exceptions import RayTaskError

        try:
            return await getattr(self.actor, method).remote(*args)
        except RayTaskError as e:
            if isinstance(e.cause, Exception):
                raise e.cause from None
            raise

    async def health(self) -> bool:
        info = await self._call("health")
        self._set(info)
        return info["ok"]

    async def load(self, adapter: str) -> None:
        await self._call("load", adapter)

    async def unload(self, adapter: str) -> None:
        await self._call("unload", adapter)

    async def fetch_from_peer(self, address: str, adapter: str) -> dict:
        return await self._call("fetch_from_peer", address, adapter)

    async def fetch_from_source(self, adapter: str) -> dict:
        return await self._call("fetch_from_source", adapter)

    async def restart(self) -> dict:
        info = await self._call("restart")
        self._set(info)
        return info


class RouterActor:
    async def start(self, spec: ClusterSpec, infos: list[dict], source_location: str,
                    registry: str) -> str:
        import ray
        import uvicorn

        from vllm_loraserve.adapters.directory import invalid_lines
        from vllm_loraserve.cluster.http import build_app
        from vllm_loraserve.cluster.router import RouterConfig, RouterCore
        from vllm_loraserve.cluster.sources import LocalDirSource
        from vllm_loraserve.cluster.store import AdapterStore
        from vllm_loraserve.perf.operating import load_profile

        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s")
        logging.getLogger("vllm.vllm_loraserve").setLevel(logging.INFO)
        valid, invalid = LocalDirSource(source_location).scan()
        logger.info("adapters in %s: %d ready, %d invalid", source_location, len(valid),
                    len(invalid))
        for line in invalid_lines(invalid):
            logger.error("%s", line)
        catalog = {e.name: e.rank for e in valid}
        if not catalog:
            logger.warning("no servable adapter in %s: only the base model is served",
                           source_location)
        handles = {i["index"]: RayEngineHandle(ray.get_actor(f"engine-{i['index']}"), i)
                   for i in infos}
        profile = load_profile(spec.profile, set(catalog.values()) or {8})
        self.core = RouterCore(handles, catalog, spec.base_model, profile, RouterConfig(
            policy=spec.policy, rebalance_s=spec.rebalance_s,
            health_interval_s=spec.health_interval_s, restart_attempts=spec.restart_attempts))
        await self.core.start()
        self.core.invalid.update(invalid)
        app = build_app(self.core, registry=AdapterStore(registry),
                        admin_token=spec.admin_token,
                        adapter_roots=[spec.adapters, *spec.allowed_roots])
        self.server = uvicorn.Server(uvicorn.Config(app, host=spec.host, port=spec.port,
                                                    log_level="warning", lifespan="off"))
        self.serve_task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.serve_task.done():
                self.serve_task.result()  # raises why it failed (e.g. port in use)
                raise RuntimeError("the router's HTTP server exited at start")
            await asyncio.sleep(0.05)
        self.loop_task = asyncio.create_task(self.core.run())
        return f"http://{spec.host}:{spec.port}"

    async def status(self) -> dict:
        return self.core.status()

    async def stop(self) -> None:
        self.loop_task.cancel()
        self.server.should_exit = True
        await self.serve_task


def plan_for(spec: ClusterSpec, device: str, workdir: str,
             serve_args: tuple[str, ...]) -> list[EnginePlan]:
    """`plan_engines` with this machine's facts: its cores, or its visible
    GPUs, their memory (NVML: the launcher holds no CUDA context on them)
    and the size of a local model's weights."""
    facts = _gpu_facts(spec.model) if device == "cuda" else {}
    return plan_engines(spec.engines, device, workdir, serve_args,
                        engines_per_gpu=spec.engines_per_gpu,
                        gpu_memory_utilization=spec.gpu_memory_utilization,
                        cpu_cores=os.cpu_count() or 1, base_port=spec.engine_base_port,
                        kv_cache_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **facts)


def _gpu_facts(model: str) -> dict:
    import torch
    from vllm.platforms import current_platform

    gpus = visible_gpus(os.environ, torch.cuda.device_count())
    return {"gpus": gpus, "model_bytes": _weights_bytes(model),
            "gpu_bytes": current_platform.get_device_total_memory(0) if gpus else None}


def _weights_bytes(model: str) -> int | None:
    """A local model directory's weight files; None for a hub name."""
    if not os.path.isdir(model):
        return None
    return sum(e.stat().st_size for e in os.scandir(model)
               if e.name.endswith((".safetensors", ".bin", ".pt"))) or None


def _device(requested: str) -> str:
    if requested != "auto":
        return requested
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


class Cluster:
    """Start with `start()` (returns the router URL), end with `stop()`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.actors: list = []
        self.router = None

    def start(self) -> str:
        from vllm_loraserve.cluster.sources import LocalDirSource

        spec = self.spec
        check_exposure(spec)  # before any socket: Ray, engines, the router
        workdir = os.path.abspath(spec.workdir)
        registry = os.path.join(workdir, "registry")
        os.makedirs(registry, exist_ok=True)
        source = os.pathsep.join([os.path.abspath(spec.adapters), registry])
        valid, _ = LocalDirSource(source).scan()
        top_rank = max((e.rank for e in valid), default=8)
        max_rank = next(r for r in SUPPORTED_RANKS if r >= top_rank)
        device = _device(spec.device)
        serve_args = ("--served-model-name", spec.base_model, "--max-lora-rank", str(max_rank),
                      "--max-cpu-loras", str(max(8, len(valid))), *spec.serve_args)
        plans = plan_for(spec, device, workdir, serve_args)  # refuses a layout before Ray
        start_ray(num_cpus=max(2, os.cpu_count() or 2))
        import ray  # after start_ray: Ray reads the loopback setting when imported
        engine_actor = ray.remote(num_cpus=0, max_concurrency=64)(Engine)
        for plan in plans:
            shutil.rmtree(plan.store_root, ignore_errors=True)
            os.makedirs(plan.workdir, exist_ok=True)
            logger.info("engine %d: %s%s", plan.index, plan.device,
                        f" (CUDA device {plan.gpu})" if plan.gpu is not None else "")
            self.actors.append(engine_actor.options(name=f"engine-{plan.index}").remote(
                EngineSpec(plan, spec.model, transport=spec.transport,
                           source=("local", source))))
        logger.info("starting %d engines (logs in %s/engine-*/server.log)", spec.engines,
                    workdir)
        infos = [info for wave in start_waves(plans)
                 for info in ray.get([self.actors[i].start.remote() for i in wave])]
        router_actor = ray.remote(num_cpus=0, max_concurrency=1000)(RouterActor)
        self.router = router_actor.options(name="router").remote()
        return ray.get(self.router.start.remote(spec, infos, source, registry))

    def engine_pids(self) -> list[int]:
        import ray

        return [ray.get(a.pid.remote()) for a in self.actors]

    def stop(self) -> None:
        if "ray" not in sys.modules:  # refused before Ray started (e.g. its plan)
            return
        import ray

        if not ray.is_initialized():
            return
        print("stopping the router, the engines and Ray ...", flush=True)
        try:
            if self.router is not None:
                ray.get(self.router.stop.remote(), timeout=30)
        finally:
            ray.get([a.stop.remote() for a in self.actors], timeout=120)
            ray.shutdown()


def up(spec: ClusterSpec) -> None:
    """Run until SIGINT/SIGTERM, then stop everything."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    cluster = Cluster(spec)
    try:
        url = cluster.start()
        print(f"router: {url}  (OpenAI API at {url}/v1, admin at {url}/admin/status); "
              "Ctrl-C stops the cluster", flush=True)
        done.wait()
    finally:
        cluster.stop()

