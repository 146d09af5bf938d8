"""The API server's catalogue of every adapter it knows, valid or not.

Adapters come from `--lora-modules`, `--loraserve-adapter-dir` and runtime
`/v1/load_lora_adapter` calls. Each is inspected (config and safetensors
header only) and checked against the served model *before* its name becomes
routable: vLLM reads adapters inside the engine step, where a bad one takes
the whole engine down. Invalid adapters stay in the catalogue with the reason,
so requests naming them get a 4xx that says what is wrong.

Invariant: an entry has exactly one of `spec` (servable) and `error`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_loraserve.adapters.peft import (
    AdapterError,
    AdapterSpec,
    ModelLoRAInfo,
    check_against_model,
    inspect_adapter,
)

RESIDENCIES = ("disk", "host", "gpu")


@dataclass
class AdapterEntry:
    name: str
    path: str
    source: str  # "lora-modules" | "adapter-dir" | "runtime"
    spec: AdapterSpec | None = None
    error: str | None = None
    lora_int_id: int | None = None
    residency: str = "disk"
    pages: int | None = None  # pages held in the paged pool, when resident there

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": self.path, "source": self.source}
        if self.spec is None:
            return {**out, "status": "invalid", "error": self.error}
        s = self.spec
        return {
            **out,
            "status": "ready",
            "rank": s.rank,
            "alpha": s.alpha,
            "use_rslora": s.use_rslora,
            "scaling": s.scaling,
            "target_modules": s.target_modules,
            "size_bytes": s.size_bytes,
            "base_model": s.base_model,
            "residency": self.residency,
            **({"pages": self.pages} if self.pages is not None else {}),
        }


def scan_adapter_dir(root: str) -> list[tuple[str, str]]:
    """(name, path) for each visible sub-directory of `root`. One that holds no
    adapter is catalogued as invalid (with the reason), not silently skipped."""
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not name.startswith("."):
            found.append((name, path))
    return found


class AdapterCatalog:
    def __init__(self, fetch_model_info: Callable[[], Awaitable[ModelLoRAInfo]]) -> None:
        self._fetch_model_info = fetch_model_info
        self._model_info: ModelLoRAInfo | None = None
        self.entries: dict[str, AdapterEntry] = {}
        self._names_by_id: dict[int, str] = {}

    async def model_info(self) -> ModelLoRAInfo:
        if self._model_info is None:
            self._model_info = await self._fetch_model_info()
        return self._model_info

    async def admit(self, name: str, path: str, source: str) -> AdapterEntry:
        """Inspect and check an adapter; record and return its entry.

        A refused replacement of a servable adapter is returned but not
        recorded: the version being served stays catalogued."""
        entry = AdapterEntry(name=name, path=os.path.abspath(path), source=source)
        try:
            spec = inspect_adapter(path)
            check_against_model(spec, await self.model_info())
            entry.spec = spec
        except AdapterError as e:
            entry.error = str(e)
        previous = self.entries.get(name)
        if entry.error is not None and previous is not None and previous.spec is not None:
            return entry
        self.entries[name] = entry
        if previous is not None and previous.lora_int_id is not None:
            self.bind(name, previous.lora_int_id)
        return entry

    def bind(self, name: str, lora_int_id: int) -> None:
        """Record the engine-side id vLLM's frontend gave this adapter."""
        self.entries[name].lora_int_id = lora_int_id
        self._names_by_id[lora_int_id] = name

    def reject(self, name: str, reason: str) -> None:
        """Mark an admitted adapter invalid (vLLM itself refused to load it)."""
        entry = self.entries[name]
        entry.spec, entry.error = None, reason

    def invalid_reason(self, name: str) -> str | None:
        entry = self.entries.get(name)
        return entry.error if entry is not None else None

    def forget(self, name: str) -> AdapterEntry | None:
        entry = self.entries.pop(name, None)
        if entry is not None and entry.lora_int_id is not None:
            self._names_by_id.pop(entry.lora_int_id, None)
        return entry

    def update_residency(self, gpu_ids: list[int], host_ids: list[int],
                         pages: dict[int, int] | None = None) -> None:
        """Tiers from a worker snapshot; `pages` (paged pool only) per GPU id."""
        gpu, host, pages = set(gpu_ids), set(host_ids), pages or {}
        for entry in self.entries.values():
            i = entry.lora_int_id
            entry.residency = "gpu" if i in gpu else "host" if i in host else "disk"
            entry.pages = pages.get(i) if i in gpu else None

    def name_of(self, lora_int_id: int) -> str | None:
        return self._names_by_id.get(lora_int_id)

    def counts(self) -> dict[str, int]:
        """Adapters per residency tier, plus invalid ones."""
        out = dict.fromkeys((*RESIDENCIES, "invalid"), 0)
        for entry in self.entries.values():
            out["invalid" if entry.spec is None else entry.residency] += 1
        return out

