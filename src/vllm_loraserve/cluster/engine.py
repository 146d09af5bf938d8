"""One cluster engine: a `vllm serve --plugin loraserve` process, the
adapter store it loads from, and the transport server its peers fetch from.

The launcher runs each `Engine` as a Ray actor (one process that starts,
watches and stops its server); the router talks to it through the actor and
sends inference traffic straight to `url`. Adapters are loaded and unloaded
at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`); with the plugin, unloading
also frees the worker's copy.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import httpx

from vllm_loraserve.cluster.engine_plan import EnginePlan
from vllm_loraserve.cluster.sources import make_source
from vllm_loraserve.cluster.store import AdapterStore
from vllm_loraserve.cluster.transport import make_transport
from vllm_loraserve.frontend import errors
from vllm_loraserve.process import Server, free_port, vllm_executable


class AdapterRejected(RuntimeError):
    """The engine refused the adapter itself (HTTP 400: malformed, rank above
    the limit, wrong base model); another engine would refuse it too."""


@dataclass(frozen=True)
class EngineSpec:
    plan: EnginePlan  # device, env, `vllm serve` arguments, port (engine_plan.py)
    model: str
    transport: str = "tcp"
    source: tuple[str, str] = ("local", "")  # (kind, location) of the adapter source
    startup_timeout_s: float = 600.0

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def workdir(self) -> str:
        return self.plan.workdir


class Engine:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        if spec.plan.gpu is not None:
            # The actor is this engine's own process: its GPU work (the nixl
            # transport's staging) then runs on cuda:0, its server's GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.plan.gpu
        self.store = AdapterStore(spec.plan.store_root)
        self.transport = make_transport(spec.transport, spec.plan.host, "cuda:0")
        self.server: Server | None = None
        self.url = ""
        self.transport_address = ""
        self._http = httpx.AsyncClient(timeout=60.0)

    async def start(self) -> dict:
        """Start the server (blocks until healthy) and the transport."""
        plan = self.spec.plan
        port = plan.port or free_port()
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **plan.env}
        log = os.path.join(plan.workdir, "server.log")
        self.server = Server(plan.command(vllm_executable(), self.spec.model, port), log, env)
        self.url = f"http://{plan.host}:{port}"
        await asyncio.to_thread(self.server.wait_ready, self.url, self.spec.startup_timeout_s,
                                False)
        if not self.transport_address:
            self.transport_address = await self.transport.serve(self.store)
        return self.info()

    def info(self) -> dict:
        return {"index": self.spec.index, "url": self.url, "pid": self.pid(),
                "transport_address": self.transport_address, "store": self.store.names()}

    def pid(self) -> int | None:
        return self.server.proc.pid if self.server else None

    async def health(self) -> dict:
        """`info()` plus `ok`: the process runs and answers /health."""
        ok = self.server is not None and self.server.proc.poll() is None
        if ok:
            try:
                ok = (await self._http.get(f"{self.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
        return {**self.info(), "ok": ok}

    async def fetch_from_peer(self, address: str, adapter: str) -> dict:
        t0 = time.perf_counter()
        nbytes = await self.transport.fetch(address, adapter, self.store)
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0,
                "via": self.transport.last_via}

    async def fetch_from_source(self, adapter: str) -> dict:
        t0 = time.perf_counter()
        source = make_source(*self.spec.source)
        await asyncio.to_thread(source.copy_to, adapter, self.store)
        return {"bytes": self.store.size_bytes(adapter), "seconds": time.perf_counter() - t0}

    async def load(self, adapter: str) -> None:
        """Register the stored adapter with vLLM (which reads it into host memory)."""
        r = await self._http.post(f"{self.url}/v1/load_lora_adapter", json={
            "lora_name": adapter, "lora_path": self.store.path(adapter)})
        if r.status_code == 400:
            try:
                error = r.json()["error"]
                kind, reason = error["type"], error["message"]
            except (ValueError, KeyError, TypeError):
                kind, reason = None, r.text[:300]
            if kind == errors.ADAPTER_LOADED:  # e.g. an unload that failed earlier
                return
            # the plugin's message (frontend/serving.py) names the adapter first
            raise AdapterRejected(reason.removeprefix(f"LoRA adapter '{adapter}' cannot be "
                                                      "served: "))
        if r.status_code != 200:
            raise RuntimeError(f"engine {self.spec.index} could not load {adapter!r}: "
                               f"HTTP {r.status_code} {r.text[:300]}")

    async def unload(self, adapter: str) -> None:
        """Unload from vLLM (frees the worker's copy) and delete the stored files."""
        r = await self._http.post(f"{self.url}/v1/unload_lora_adapter",
                                  json={"lora_name": adapter})
        if r.status_code not in (200, 404):
            raise RuntimeError(f"engine {self.spec.index} could not unload {adapter!r}: "
                               f"{r.text[:300]}")
        self.store.remove(adapter)

    async def kill(self) -> None:
        """Stop the server at once (fault injection and shutdown)."""
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, 5.0)

    async def restart(self) -> dict:
        """A fresh server; its vLLM holds no adapters, so the store is emptied too."""
        await self.kill()
        for name in self.store.names():
            self.store.remove(name)
        return await self.start()

    async def stop(self) -> None:
        await self.kill()
        await self.transport.close()
        await self._http.aclose()
