"""An adapter by name and rank: what placement, the router, the traces and
the simulator know of it (the PEFT files behind a name are `peft.PeftSpec`).

An adapter catalogue file is a JSON list of {"name", "rank"}; the workload
generators write it, `loraserve place` and `loraserve bench simulate` read it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    rank: int


def write_catalog(path: str, adapters: Sequence[AdapterRecord]) -> None:
    with open(path, "w") as f:
        json.dump([asdict(a) for a in adapters], f, indent=1)


def read_catalog(path: str) -> list[AdapterRecord]:
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: an adapter catalogue is a JSON list of {{name, rank}}")
    adapters = [AdapterRecord(str(a["name"]), int(a["rank"])) for a in raw]
    if len({a.name for a in adapters}) != len(adapters):
        raise ValueError(f"{path}: adapter names must be unique")
    return adapters
