"""register(): patches only where the plugin was requested; a vLLM that moved
a patched symbol gets a warning (unrequested) or a refusal (requested)."""

from __future__ import annotations

import logging

import pytest

from vllm_loraserve import plugin
from vllm_loraserve._patching import PatchTargetMissing, wrap


@pytest.mark.parametrize("argv, expected", [
    (["vllm", "serve", "m"], False),
    (["vllm", "serve", "m", "--plugin", "loraserve"], True),
    (["vllm", "serve", "m", "--plugin=loraserve"], True),
    (["vllm", "serve", "m", "--plugin", "other"], False),
    (["vllm", "serve", "m", "--loraserve-adapter-dir", "/a"], True),
    (["vllm", "serve", "m", "--additional-config", '{"loraserve": {}}'], True),
    (["vllm", "serve", "m", "--additional_config={\"loraserve\": {\"pool\": \"vllm\"}}"], True),
    (["vllm", "serve", "m", "--additional-config", '{"other": "loraserve"}'], False),
    (["vllm", "serve", "m", "--additional-config.loraserve.pool", "vllm"], True),
    (["vllm", "serve", "loraserve"], False),
])
def test_requested_on_command_line(argv, expected):
    assert plugin.requested_on_command_line(argv) is expected


def _frame_in_vllm(local: dict):
    """A frame of code whose module is `vllm.*`, with `local` as its locals."""
    import sys

    namespace = {"__name__": "vllm.fake_call_site", "sys": sys}
    exec("def call_site(vllm_config=None, self=None):\n    return sys._getframe(0)\n",
         namespace)
    return namespace["call_site"](**local)


class _Config:
    def __init__(self, extra):
        self.additional_config = extra


def test_requested_by_the_config_being_built():
    """EngineArgs (self) in __post_init__, VllmConfig (vllm_config) in the
    engine core and the workers."""
    argv = ["python", "script.py"]
    assert plugin.requested(argv, _frame_in_vllm({"self": _Config({"loraserve": {}})}))
    assert plugin.requested(argv, _frame_in_vllm({"vllm_config": _Config({"loraserve": {}})}))
    assert not plugin.requested(argv, _frame_in_vllm({"vllm_config": _Config({"x": 1})}))
    assert not plugin.requested(argv, _frame_in_vllm({}))
    # the same locals outside vLLM's code do not count
    assert not plugin.requested(argv, _Frame({"self": _Config({"loraserve": {}})}))


class _Frame:
    def __init__(self, local):
        self.f_globals, self.f_locals, self.f_back = {"__name__": "user.module"}, local, None


def test_wrap_names_a_missing_target():
    class Owner:
        def present(self):
            return 1

    class Child(Owner):
        pass

    with pytest.raises(PatchTargetMissing, match=r"Owner\.absent is missing"):
        wrap(Owner, "absent", lambda f: f)
    # inherited: patching it on the subclass would be a silent fork of behaviour
    with pytest.raises(PatchTargetMissing, match=r"Child\.present is missing"):
        wrap(Child, "present", lambda f: f)
    assert wrap(Owner, "present", lambda f: lambda self: 2) is True
    assert Owner().present() == 2


def _wrapped_now():
    """Every function this package wrapped, over the classes it patches."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    out = []
    for cls in (EngineArgs, EngineCore):
        for name, raw in vars(cls).items():
            if hasattr(getattr(raw, "__func__", raw), "__loraserve_original__"):
                out.append(f"{cls.__name__}.{name}")
    return sorted(out)


def test_missing_target_warns_when_not_requested(monkeypatch, caplog):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.delattr(EngineCore, "remove_lora")
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m"])
    before = _wrapped_now()
    # vLLM's logger does not propagate to the root logger that caplog
    # listens on (unless an earlier test configured logging): listen on it.
    plugin.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.vllm_loraserve.plugin"):
            plugin.register()
    finally:
        plugin.logger.removeHandler(caplog.handler)
    assert "vllm.v1.engine.core.EngineCore.remove_lora is missing" in caplog.text
    assert _wrapped_now() == before


def test_missing_target_refuses_when_requested(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.delattr(EngineCore, "remove_lora")
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--plugin", "loraserve"])
    before = _wrapped_now()
    with pytest.raises(SystemExit, match=r"EngineCore\.remove_lora is missing"):
        plugin.register()
    assert _wrapped_now() == before


def test_changed_signature_refuses_when_requested(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "add_lora", lambda self, request, extra=None: True)
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--plugin", "loraserve"])
    with pytest.raises(SystemExit, match=r"EngineCore\.add_lora changed its signature"):
        plugin.register()


def test_not_requested_patches_nothing(monkeypatch):
    """Fresh process: importing vLLM's CLI and calling register() without the
    plugin leaves every vLLM function as it was."""
    import subprocess
    import sys

    code = (
        "import sys; sys.argv = ['vllm', 'serve', 'm']\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm_loraserve import plugin\n"
        "plugin.register()\n"
        "import importlib, vllm.v1.engine.core as c\n"
        "r = importlib.import_module('torch.distributed.rendezvous')\n"
        "funcs = [EngineArgs.__dict__['add_cli_args'], c.EngineCore.__dict__['add_lora'],\n"
        "         r._rendezvous_handlers['tcp']]\n"
        "print('PATCHED', [f for f in funcs if 'vllm_loraserve' in\n"
        "      getattr(getattr(f, '__func__', f), '__code__').co_filename])\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith('vllm_loraserve.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PATCHED []" in out.stdout
    loaded = out.stdout.split("LOADED ")[1]
    assert "frontend" not in loaded and "worker" not in loaded and "scheduler" not in loaded


PINNED = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


@pytest.mark.parametrize("environ, expected", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": PINNED}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True," + PINNED}),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
     {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64," + PINNED}),
    # Both set: torch versions differ in which one they read, so both get it.
    ({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
     {"PYTORCH_ALLOC_CONF": PINNED, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64," + PINNED}),
    # What the user gave stands; only the missing setting is added.
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4"},
     {"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4,"
                                 "pinned_use_cuda_host_register:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False,"
                                 "pinned_num_register_threads:2"},
     {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False,"
                                 "pinned_num_register_threads:2"}),
])
def test_pinned_memory_by_host_register_unless_the_user_chose(environ, expected):
    plugin.use_registered_pinned_memory(environ)
    plugin.use_registered_pinned_memory(environ)  # idempotent
    assert environ == expected
