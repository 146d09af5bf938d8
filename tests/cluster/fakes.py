"""In-memory engines for router tests: `EngineHandle`s that record what the
router asked of them, with switches for faults; fake vLLM servers for their
`url`, in a thread (`UpstreamServer`) or in a process that can be killed,
stopped and started again on its port (`UpstreamProcess`)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_loraserve.cluster.engine import AdapterRejected
from vllm_loraserve.process import free_port


@dataclass
class FakeEngine:
    index: int
    world: list  # shared event log: (engine, verb, adapter[, source])
    peers: dict  # transport address -> FakeEngine
    url: str = ""
    pid: int | None = None
    up: bool = True
    stored: set = field(default_factory=set)
    loaded: set = field(default_factory=set)
    refuse: dict = field(default_factory=dict)  # adapter -> reason (HTTP 400)
    broken_loads: set = field(default_factory=set)  # adapter -> load fails (not 400)
    load_gates: dict = field(default_factory=dict)  # adapter -> asyncio.Event a load awaits
    restarts: int = 0
    gate: object = None  # an asyncio.Event a restart waits for, if set
    # its server, when it is a process: health asks its /health (as the real
    # Engine does), restart starts it again
    process: UpstreamProcess | None = None
    # How long its /health may take: generous, as a loaded CI machine can
    # stall a healthy fake for seconds; a test of a hung engine shortens it.
    health_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        self.url = self.url or f"http://fake-{self.index}"
        self.pid = 1000 + self.index
        self.transport_address = f"fake:{self.index}"
        self.peers[self.transport_address] = self

    async def health(self) -> bool:
        if self.process is None or not self.up:
            return self.up
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{self.url}/health",
                                         timeout=self.health_timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def load(self, adapter: str) -> None:
        if not self.up:
            raise ConnectionError(f"engine {self.index} is down")
        if adapter in self.refuse:
            raise AdapterRejected(self.refuse[adapter])
        if adapter in self.broken_loads:
            raise RuntimeError("HTTP 500")
        assert adapter in self.stored, "vLLM loads from the store"
        if adapter in self.load_gates:
            await self.load_gates[adapter].wait()
        self.loaded.add(adapter)
        self.world.append((self.index, "load", adapter))

    async def unload(self, adapter: str) -> None:
        self.loaded.discard(adapter)
        self.stored.discard(adapter)
        self.world.append((self.index, "unload", adapter))

    async def fetch_from_peer(self, address: str, adapter: str) -> dict:
        peer = self.peers[address]
        assert adapter in peer.stored, f"peer {peer.index} does not hold {adapter}"
        self.stored.add(adapter)
        self.world.append((self.index, "fetch", adapter, f"peer-{peer.index}"))
        return {"bytes": 1, "seconds": 0.001, "via": "tcp"}

    async def fetch_from_source(self, adapter: str) -> dict:
        self.stored.add(adapter)
        self.world.append((self.index, "fetch", adapter, "registry"))
        return {"bytes": 1, "seconds": 0.001}

    async def restart(self) -> dict:
        if self.gate is not None:
            await self.gate.wait()
        self.restarts += 1
        self.up = True
        if self.process is not None:
            await asyncio.to_thread(self.process.start)
            self.pid = self.process.proc.pid
        self.stored.clear()
        self.loaded.clear()
        return {"index": self.index}


def fake_engines(n: int, urls: list[str] | None = None) -> tuple[dict[int, FakeEngine], list]:
    world: list = []
    peers: dict = {}
    engines = {i: FakeEngine(i, world, peers, url=(urls[i] if urls else "")) for i in range(n)}
    return engines, world


class _StreamOptions(BaseModel):
    include_usage: bool | None = False


class _Request(BaseModel):
    """The fields of vLLM's CompletionRequest that the router reads too,
    typed as vLLM types them (pydantic's lax mode: "no" is False)."""

    model_config = ConfigDict(extra="allow")
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    temperature: float | None = None


def _refusal(message: str, param: str | None) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": {
        "message": message, "type": "BadRequestError", "param": param, "code": 400}})


# How long a "slow" answer takes: past what a test gives the router (0.5 s
# upstream timeout, 6 s for a client that leaves) by more than a loaded CI
# machine's stall.
SLOW_S = 8.0


def upstream_app(index: int, model_info: dict | None = None):
    """A stand-in for `vllm serve`: /v1/completions answers with its engine
    index; streams when asked; the prompt "break" drops the connection after
    the first chunk (an engine dying mid-response); "slow" waits SLOW_S before
    answering (or after the first chunk when streaming); on engine `index`
    only, "hold-<index>" never answers (streamed: nothing after the headers)
    and "hold-after-first-<index>" streams one chunk, then nothing: requests
    in flight when the engine is killed or stopped; "http-500-<index>" and
    "http-503-<index>" answer that status (an engine failing, or dying). It refuses, with
    vLLM's 400 and the value it got in the message, what vLLM refuses of
    the fields `_Request` names: a wrong type, `stream_options` without
    `stream`, a temperature that is not finite.
    /loraserve/v1/model answers `model_info` (404 without one)."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/loraserve/v1/model")
    async def model():
        if model_info is None:
            return StreamingResponse(iter([b"{}"]), status_code=404)
        return model_info

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream_options") and not body.get("stream"):  # as vLLM: before parsing
            return _refusal("Stream options can only be defined when `stream=True`.",
                            "stream_options")
        try:
            req = _Request.model_validate(body)
        except ValidationError as e:
            return _refusal(str(e), None)
        if req.temperature is not None and not math.isfinite(req.temperature):
            return _refusal(f"temperature must be a finite number, got {req.temperature}.",
                            "temperature")
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        choice = {"index": 0, "text": f"engine-{index}", "finish_reason": "length"}
        slow = body.get("prompt") == "slow"
        hold = body.get("prompt") == f"hold-{index}"
        for status in (500, 503):
            if body.get("prompt") == f"http-{status}-{index}":
                return JSONResponse(status_code=status, content={"error": {
                    "message": f"engine {index} says {status}", "type": "EngineError",
                    "param": None, "code": status}})
        if not req.stream:
            if slow:
                await asyncio.sleep(SLOW_S)
            if hold:
                await asyncio.Event().wait()
            return {"model": body["model"], "choices": [choice], "usage": usage}

        async def events():
            if hold:
                await asyncio.Event().wait()
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if body.get("prompt") == f"hold-after-first-{index}":
                await asyncio.Event().wait()
            if slow:
                await asyncio.sleep(SLOW_S)
            if body.get("prompt") == "break":
                raise RuntimeError("engine died")
            if req.stream_options and req.stream_options.include_usage:
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class UpstreamServer:
    """`upstream_app` served by uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, index: int, model_info: dict | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(upstream_app(index, model_info),
                                                    host="127.0.0.1",
                                                    port=port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake upstream did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class UpstreamProcess:
    """`upstream_app` in its own process on a fixed port: `kill` (SIGKILL,
    the OS resets its connections), `pause`/`resume` (SIGSTOP/SIGCONT: it
    hangs with its connections open), `start` again on the same port."""

    def __init__(self, index: int) -> None:
        self.index, self.port = index, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.fakes",
                                      str(self.index), str(self.port)], cwd=root)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, "fake upstream process exited"
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "fake upstream process did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


if __name__ == "__main__":  # UpstreamProcess: python -m tests.cluster.fakes INDEX PORT
    uvicorn.run(upstream_app(int(sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]),
                log_level="critical")
