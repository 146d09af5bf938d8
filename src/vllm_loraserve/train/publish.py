"""Versions of trained adapters: saved as PEFT directories `out/name@step/`
and loaded into running servers while they serve.

A server (`vllm serve --plugin loraserve`) gets each version through its
runtime load API; loading `name@step` moves the server's alias `name` to it
(frontend/serving.py), so new requests for `name` get the new version and
requests in flight finish on theirs. A cluster router gets `name@step`
through `POST /admin/adapters`. Versions are never unloaded here: a request
in flight may still use one.
"""

from __future__ import annotations

import os

import httpx

from vllm_loraserve.adapters.peft import write_adapter
from vllm_loraserve.train.config import PublishConfig


def version_name(name: str, step: int) -> str:
    return f"{name}@{step}"


def save_adapter(trainer, name: str, path: str, base_model: str) -> str:
    cfg = trainer.configs[name]
    write_adapter(path, trainer.adapter_weights(name), rank=cfg.rank, alpha=cfg.alpha,
                  base_model=base_model, use_rslora=cfg.use_rslora)
    return path


def save_versions(trainer, out_dir: str, step: int, base_model: str) -> dict[str, str]:
    """`name@step` -> directory, one per adapter."""
    return {version_name(n, step): save_adapter(trainer, n, os.path.join(
        out_dir, version_name(n, step)), base_model) for n in trainer.configs}


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")


def publish(versions: dict[str, str], cfg: PublishConfig, timeout_s: float = 120.0) -> None:
    """Load every version into every configured server and router; raises
    RuntimeError naming the first that refused."""
    with httpx.Client(timeout=timeout_s) as client:
        for vname, path in versions.items():
            path = os.path.abspath(path)
            for url in cfg.servers:
                _check(client.post(f"{url}/v1/load_lora_adapter",
                                   json={"lora_name": vname, "lora_path": path}),
                       f"{url} refused {vname}")
            if cfg.router:
                _check(client.post(f"{cfg.router}/admin/adapters",
                                   json={"name": vname, "path": path}),
                       f"router {cfg.router} refused {vname}")
