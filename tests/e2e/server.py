"""A `vllm serve` process for tests, started the way a user types it."""

from __future__ import annotations

import contextlib
import os

import httpx

from vllm_loraserve.process import Server, free_port, vllm_executable


@contextlib.contextmanager
def vllm_server(model: str, extra_args: list[str], log_dir: str, env: dict | None = None,
                dtype: str = "float32", timeout: float = 300):
    """Yield the base URL of a running server; stop it by its PID afterwards."""
    port = free_port()
    cmd = [vllm_executable(), "serve", model, "--enable-lora", "--dtype", dtype,
           "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    server = Server(cmd, os.path.join(log_dir, "server.log"), env)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready(url, timeout=timeout)
        yield url
    finally:
        server.stop()


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, sorted labels): value} for loraserve metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("loraserve_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
