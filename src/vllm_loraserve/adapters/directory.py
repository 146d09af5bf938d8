"""A directory of PEFT adapter directories, each served under its own name
(`--loraserve-adapter-dir`, the cluster's `--adapters`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_loraserve.adapters.peft import AdapterError, inspect_adapter
from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.adapters.safety import check_name, resolve_adapter_under_roots

# Start-up logs name this many invalid adapters, then count the rest: a
# directory of thousands of broken adapters must not bury the log.
MAX_LOGGED_INVALID = 20


def invalid_lines(invalid: Mapping[str, str], limit: int = MAX_LOGGED_INVALID) -> list[str]:
    """Log lines for invalid adapters (name -> reason): one per adapter, at
    most `limit`, then one counting the others."""
    lines = [f"adapter '{name}' is not served: {reason}"
             for name, reason in list(invalid.items())[:limit]]
    if len(invalid) > limit:
        lines.append(f"... and {len(invalid) - limit} more invalid adapters")
    return lines


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
    first root holding a name wins. Reads configs and headers only, of
    adapters whose files all lie inside `roots`."""
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
                spec = inspect_adapter(resolve_adapter_under_roots(path, roots))
            except (AdapterError, ValueError) as e:  # PathOutsideRoots too
                invalid[name] = str(e)
                continue
            valid.append(AdapterRecord(name, spec.rank))
    return valid, invalid
