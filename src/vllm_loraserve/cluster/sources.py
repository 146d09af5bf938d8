"""Where adapters come from before any engine holds them, by name.

A source lists the adapters it can supply (validated PEFT adapters with their
rank; invalid ones are reported with the reason, never placed) and copies one
into an engine's store. `local`: a directory of PEFT adapter directories.
"""

from __future__ import annotations

import os
from typing import Protocol

from vllm_loraserve.adapters.directory import scan_adapter_dirs
from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.adapters.safety import resolve_adapter_under_roots
from vllm_loraserve.cluster.store import AdapterStore, check_name


class AdapterSource(Protocol):
    name: str

    def scan(self) -> tuple[list[AdapterRecord], dict[str, str]]:
        """(valid adapters, invalid name -> reason)."""
        ...

    def copy_to(self, adapter: str, store: AdapterStore) -> None: ...


class LocalDirSource:
    """Directories of PEFT adapters (`location`: roots joined by os.pathsep);
    the first root holding a name wins."""

    name = "local"

    def __init__(self, location: str) -> None:
        self.roots = [r for r in location.split(os.pathsep) if r]

    def scan(self) -> tuple[list[AdapterRecord], dict[str, str]]:
        return scan_adapter_dirs(self.roots)

    def copy_to(self, adapter: str, store: AdapterStore) -> None:
        for root in self.roots:
            path = os.path.join(root, check_name(adapter))
            if os.path.isdir(path):
                # checked at the scan too, but the files may have changed since
                store.copy_in(adapter, resolve_adapter_under_roots(path, self.roots))
                return
        raise KeyError(f"no adapter {adapter!r} in {self.roots}")


SOURCES = {"local": LocalDirSource}


def make_source(kind: str, location: str) -> AdapterSource:
    if kind not in SOURCES:
        raise ValueError(f"unknown adapter source {kind!r}; available: {sorted(SOURCES)}")
    return SOURCES[kind](location)
