"""benchmarks/e2e/online_ttft.py `--start-in host` without a server: the
adapters are prefetched in the order of their first request, until the host
tier has no room, and the replay waits for every read started."""

from __future__ import annotations

import json
import os
import sys

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "e2e"))
import online_ttft  # noqa: E402

sys.path.pop(0)


def test_prefetch_in_first_use_order_until_no_room_then_waits_for_reads(tmp_path):
    trace = tmp_path / "trace.jsonl"
    uses = ["r8-2", "r8-0", "r8-2", "r16-1", "r8-0", "r16-0", "r8-1"]
    trace.write_text("".join(json.dumps({"request_id": i, "arrival_s": i, "adapter": a}) + "\n"
                             for i, a in enumerate(uses)))
    mapping = {"r8-0": "a0", "r8-1": "a1", "r8-2": "a2", "r16-0": "a3", "r16-1": "a4"}
    asked: list[str] = []
    reading = {"a0": 2}  # a0's read answers 202 twice more before it is in the tier
    answers = {"a2": 200, "a4": 400, "a3": 409}  # a4 is unservable; no room for a3

    def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.path.split("/")[-2]
        asked.append(name)
        if reading.get(name):
            reading[name] -= 1
            return httpx.Response(202, json={"state": "reading"})
        return httpx.Response(answers.get(name, 200))

    with httpx.Client(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as c:
        counts = online_ttft.prefetch(c, str(trace), mapping, poll_s=0)
    assert asked == ["a2", "a0", "a4", "a3", "a0", "a0"]  # a1 after a3's 409: not asked
    assert counts == {"adapters": 5, "in_host": 2, "failed": 1, "still_reading": 0}
