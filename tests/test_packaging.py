"""The package as a user installs it: the sdist and the wheel build without
a warning and pass `twine check`; the wheel, built from the sdist and
installed alone into a fresh venv (no index, no dependencies), holds the
package data and licenses and registers vLLM's three plugin entry points
and the `loraserve` command, whose modules that need no dependency import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# What the build reads; a copy keeps build/ and *.egg-info out of the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in", "src", "csrc")
ENTRY_POINTS = {  # "group name": object
    "vllm.general_plugins loraserve": "vllm_loraserve.plugin:register",
    "vllm.endpoint_plugins loraserve": "vllm_loraserve.frontend.endpoint:LoraServeEndpoint",
    "vllm.stat_logger_plugins loraserve":
        "vllm_loraserve.frontend.metrics:LoraServeStatLogger",
    "console_scripts loraserve": "vllm_loraserve.cli.main:main",
}
# Run in the fresh venv: what an installed wheel offers without its dependencies.
PROBE = """
import importlib, importlib.metadata as md, importlib.resources as res, json
import vllm_loraserve, vllm_loraserve.plugin, vllm_loraserve.cli.main
dist = md.distribution("vllm-loraserve")
points = {f"{e.group} {e.name}": e.value for e in dist.entry_points}
modules = {e.value.split(":")[0] for e in dist.entry_points}
print(json.dumps({
    "file": vllm_loraserve.__file__,
    "points": points,
    "modules_present": all(res.files("vllm_loraserve").joinpath(
        *m.split(".")[1:-1], m.split(".")[-1] + ".py").is_file() for m in modules),
    "register": callable(vllm_loraserve.plugin.register),
    "data": sorted(p.name for p in res.files("vllm_loraserve.workloads").joinpath("data")
                   .iterdir()),
    "licenses": sorted(p.name for p in dist.files if "licenses" in str(p)),
    "license": dist.metadata["License-Expression"],
}))
"""


def _run(cmd: list[str], **kw) -> str:
    # no PYTHONPATH: the fresh venv must import the wheel, not this checkout
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_wheel_builds_cleanly_and_installs_alone(tmp_path):
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    src.mkdir()
    for name in SOURCES:
        if name in ("src", "csrc"):
            shutil.copytree(os.path.join(ROOT, name), src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(os.path.join(ROOT, name), src / name)
    log = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                str(src)])
    assert "warning" not in log.lower(), [x for x in log.splitlines() if "warn" in x.lower()]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    with tarfile.open(sdist) as tar:  # no stray test files (setuptools adds tests/test*.py)
        top = {n.split("/")[1] for n in tar.getnames() if "/" in n}
    assert top == {"PKG-INFO", "README.md", "LICENSE", "MANIFEST.in", "pyproject.toml",
                   "setup.cfg", "setup.py", "src", "csrc"}, top

    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)])
    got = json.loads(_run([python, "-c", PROBE], cwd=tmp_path).splitlines()[-1])
    assert got["file"].startswith(str(venv))
    assert got["points"] == ENTRY_POINTS
    assert got["modules_present"] and got["register"]
    assert got["data"] == ["LICENSE-AzurePublicDataset", "README.md", "azure_code_2023.csv",
                           "azure_conv_2023.csv"]
    assert got["licenses"] == ["LICENSE", "LICENSE-AzurePublicDataset"]
    assert got["license"] == "Apache-2.0 AND CC-BY-4.0"
    assert os.access(venv / "bin" / "loraserve", os.X_OK)
