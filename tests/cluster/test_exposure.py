"""`loraserve cluster up` on a non-loopback --host needs an admin token, and
refuses before any socket is opened."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from vllm_loraserve.cli.main import main
from vllm_loraserve.cluster.launch import ClusterSpec, check_exposure


def test_check_exposure():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(ClusterSpec(engines=1, model="m", adapters="a", host=host))
    check_exposure(ClusterSpec(engines=1, model="m", adapters="a", host="0.0.0.0",
                               admin_token="t"))
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org", ""):
        with pytest.raises(ValueError, match="without an admin token"):
            check_exposure(ClusterSpec(engines=1, model="m", adapters="a", host=host))


def test_up_refuses_before_opening_a_socket(monkeypatch, tmp_path, capsys):
    opened = []
    for name in ("bind", "listen", "connect"):
        real = getattr(socket.socket, name)
        monkeypatch.setattr(socket.socket, name,
                            lambda self, *a, _n=name, _r=real: (opened.append(_n), _r(self, *a)))
    monkeypatch.delenv("LORASERVE_ADMIN_TOKEN", raising=False)
    had_ray = "ray" in sys.modules
    with pytest.raises(SystemExit) as e:
        main(["cluster", "up", "--host", "0.0.0.0", "--model", "m", "--adapters",
              str(tmp_path)])
    assert "without an admin token: pass --admin-token" in str(e.value.code)
    assert opened == [] and ("ray" in sys.modules) == had_ray


def test_up_exits_nonzero_with_a_message(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vllm_loraserve.cli.main", "cluster", "up",
                          "--host", "0.0.0.0", "--model", "m", "--adapters", str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items()
                              if k != "LORASERVE_ADMIN_TOKEN"})
    assert out.returncode != 0
    assert "refusing to serve the router on --host 0.0.0.0" in out.stderr
