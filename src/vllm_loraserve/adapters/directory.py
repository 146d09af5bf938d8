"""A directory of PEFT adapter directories, each served under its own name
(`--loraserve-adapter-dir`, the cluster's `--adapters`)."""

from __future__ import annotations

import os

from vllm_loraserve.adapters.peft import AdapterError, inspect_adapter
from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.adapters.safety import check_name


def scan_adapter_dir(root: str) -> list[tuple[str, str]]:
    """(name, path) for each visible sub-directory of `root`. One that holds no
    adapter is catalogued as invalid (with the reason), not silently skipped."""
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not name.startswith("."):
            found.append((name, path))
    return found


def scan_adapter_dirs(roots: list[str]) -> tuple[list[AdapterRecord], dict[str, str]]:
    """(valid adapters, invalid name -> reason) over `roots` in order; the
    first root holding a name wins. Reads configs and headers only."""
    valid, invalid, seen = [], {}, set()
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name, path in scan_adapter_dir(root):
            if name in seen:
                continue
            seen.add(name)
            try:
                check_name(name)
                spec = inspect_adapter(path)
            except (AdapterError, ValueError) as e:
                invalid[name] = str(e)
                continue
            valid.append(AdapterRecord(name, spec.rank))
    return valid, invalid
