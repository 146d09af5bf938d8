"""The trace format shared by generators, the replay client and the simulator.

A trace is JSONL, one request per line:

    {"request_id": 0, "arrival_s": 0.41, "adapter": "a003-r16", "rank": 16,
     "prompt_len": 212, "output_len": 37}

`arrival_s` is seconds from the start, non-decreasing. The adapters a trace
names are listed in a catalogue file (adapters/record.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    adapter: str
    rank: int
    prompt_len: int
    output_len: int


def write_trace(path: str, requests: Iterable[Request]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def read_trace(path: str) -> list[Request]:
    with open(path) as f:
        requests = [Request(**json.loads(line)) for line in f if line.strip()]
    for a, b in zip(requests, requests[1:], strict=False):
        if b.arrival_s < a.arrival_s:
            raise ValueError(f"{path}: arrivals must not decrease (request {b.request_id})")
    return requests

