"""free_port: ports outside the kernel's ephemeral range, so that no socket
bound to port 0 elsewhere takes one between its pick and the server's bind."""

from __future__ import annotations

import socket

import pytest

from vllm_loraserve import process


def test_free_port_lies_below_the_ephemeral_range_and_binds():
    top = min(process._ephemeral_low(), process._PORT_CEILING)
    if top - process._PORT_SPAN < 1024:
        pytest.skip(f"no room below this host's ephemeral range ({top}): the kernel picks")
    for _ in range(20):
        port = process.free_port()
        assert top - process._PORT_SPAN <= port < top
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_free_port_skips_a_taken_port(monkeypatch):
    with socket.socket() as taken, socket.socket() as freed:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        freed.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], freed.getsockname()[1]
        freed.close()
        low = max(busy, free) + 1
        monkeypatch.setattr(process, "_ephemeral_low", lambda: low)
        monkeypatch.setattr(process, "_PORT_CEILING", low)
        monkeypatch.setattr(process, "_PORT_SPAN", low - 1024)
        # The draw offers the busy port first.
        monkeypatch.setattr(process._rng, "sample", lambda r, k: [busy, free])
        assert process.free_port() == free


def test_free_port_falls_back_to_the_kernels_pick_without_a_range(monkeypatch):
    monkeypatch.setattr(process, "_ephemeral_low", lambda: 1500)  # no room below it

    def no_draw(*_):
        raise AssertionError("drew from a range that does not exist")
    monkeypatch.setattr(process._rng, "sample", no_draw)
    port = process.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
