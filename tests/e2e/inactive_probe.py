"""Imported as `sitecustomize` into every process of a stock `vllm serve`
(tests/e2e/test_inactive.py): simulates a vLLM that lacks one symbol the
plugin patches, and reports from each process whether the plugin was
registered and which vLLM functions (if any) were replaced by its code.

Reports go to $LORASERVE_PROBE_DIR/<pid>.json, rewritten every 0.3 s.
"""

import json
import os
import sys
import threading
import time
import warnings

from vllm_loraserve import compat, plugin

MISSING = "vllm.engine.arg_utils:EngineArgs.loraserve_simulated_missing"
compat.CONTRACT = (*compat.CONTRACT, compat.Symbol(MISSING, patch=True, why="simulated"))

_state = {"registered": 0}
_register = plugin.register


def register():
    _state["registered"] += 1
    return _register()


plugin.register = register  # what vLLM's entry point resolves


def _ours(obj):
    try:
        func = getattr(obj, "__func__", obj)
        code = getattr(func, "__code__", None)
        return hasattr(func, "__loraserve_original__") or (
            code is not None and "vllm_loraserve" in code.co_filename)
    except Exception:  # lazy placeholders (e.g. optional modules) raise on access
        return False


def _scan():
    warnings.simplefilter("ignore")  # deprecated module attributes warn when read
    found = []
    for name, mod in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith(("vllm.", "torch.distributed"))):
            continue
        for attr, val in list(vars(mod).items()):
            items = [(attr, val)]
            if isinstance(val, type) and val.__module__ == name:
                items += [(f"{attr}.{k}", v) for k, v in list(vars(val).items())]
            found += [f"{name}.{label}" for label, obj in items if _ours(obj)]
        if name == "torch.distributed.rendezvous":
            found += [f"{name}._rendezvous_handlers[{k!r}]"
                      for k, h in vars(mod)["_rendezvous_handlers"].items() if _ours(h)]
    return sorted(set(found))


def _report():
    out = os.path.join(os.environ["LORASERVE_PROBE_DIR"], f"{os.getpid()}.json")
    while True:
        try:
            report = {"argv": sys.argv, "registered": _state["registered"], "wrapped": _scan()}
            with open(out + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(out + ".tmp", out)
        except Exception as e:  # a module mutating under the scan: try again
            print(f"probe: {e}", file=sys.stderr)
        time.sleep(0.3)


def _start():
    threading.Thread(target=_report, daemon=True).start()


_start()
os.register_at_fork(after_in_child=_start)
