"""bench/replay.py's pure parts: the prompt builder and the split of TTFT
into each adapter's first request and the later ones."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest

from vllm_loraserve.bench import replay


def test_token_prompt_is_exactly_length_ids_in_range():
    rng = random.Random(0)
    for length in (0, 1, 128, 2048):
        p = replay.token_prompt(rng, length, (4, 32000))
        assert len(p) == length and all(4 <= t < 32000 for t in p)
    assert replay.token_prompt(random.Random(3), 64, (4, 10)) == \
        replay.token_prompt(random.Random(3), 64, (4, 10))


def _outcome(i: int, model: str, sent: float, ttft: float | None,
             error: str | None = None) -> replay.Outcome:
    return replay.Outcome(i, model, model, 8, 16, 2, sent_s=sent, ttft_s=ttft, error=error)


def test_first_and_later_by_send_time_per_served_name():
    # listed out of send order: the split must go by sent_s, not list position
    outcomes = [_outcome(0, "a", 0.5, 0.1), _outcome(1, "b", 0.3, 0.15),
                _outcome(2, "a", 0.0, 1.0), _outcome(3, "b", 0.2, None, "HTTP 500"),
                _outcome(4, "a", 1.0, 0.2), _outcome(5, "c", 2.0, 3.0)]
    split = replay.first_and_later(outcomes)
    first, later = split["first"], split["later"]
    # first: a@0.0 (1.0 s), b@0.2 (failed), c@2.0 (3.0 s)
    assert (first["n"], first["errors"]) == (3, 1)
    assert first["ttft_s"]["p50"] == np.percentile([1.0, 3.0], 50)
    assert first["ttft_s"]["p99"] == np.percentile([1.0, 3.0], 99)
    # later: a@0.5, b@0.3, a@1.0
    assert (later["n"], later["errors"]) == (3, 0)
    assert later["ttft_s"]["p50"] == 0.15
    assert later["ttft_s"]["p99"] == np.percentile([0.1, 0.15, 0.2], 99)
    assert first["n"] + later["n"] == len(outcomes)


def test_first_and_later_one_request_per_adapter_has_no_later():
    split = replay.first_and_later([_outcome(0, "a", 0.0, 0.4), _outcome(1, "b", 0.1, 0.6)])
    assert split["first"]["n"] == 2 and split["later"] == {"n": 0, "errors": 0, "ttft_s": {}}


def test_stream_timings_against_a_stream_of_known_pace():
    """A fake server sends the first token after FIRST_S, then one token every
    GAP_S, then a usage chunk with no choices. TTFT must be at least FIRST_S
    and TPOT (last - first) / (tokens - 1): a client that divided by `tokens`
    would read 0.8 * GAP_S, one that counted the TTFT in would read 1.75 * GAP_S."""
    first_s, gap_s, tokens = 0.6, 0.2, 5

    async def body():
        await asyncio.sleep(first_s)
        for k in range(tokens):
            if k:
                await asyncio.sleep(gap_s)
            yield f'data: {json.dumps({"choices": [{"text": "x"}]})}\n\n'.encode()
        usage = {"choices": [], "usage": {"completion_tokens": tokens}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    async def run() -> replay.Outcome:
        out = replay.Outcome(0, "a", "a", 8, 4, tokens)
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            await replay.stream_one(client, "http://fake", out, [1, 2, 3, 4], 0.0)
        return out

    out = asyncio.run(run())
    assert out.error is None and out.output_tokens == tokens and len(out.tbt_s) == tokens - 1
    # Sleeps never end early, so lower bounds hold; a loaded CI machine can
    # stretch any gap, so no upper bound on a timing. The formula is pinned
    # by the equality: either wrong one above differs from it.
    assert out.ttft_s >= first_s
    assert out.tpot_s >= gap_s * 0.95
    assert out.tpot_s == pytest.approx(sum(out.tbt_s) / (tokens - 1))
    assert out.e2e_s >= first_s + (tokens - 1) * gap_s
