"""The patch contract: every vLLM symbol the plugin patches or reads is where
the plugin expects it. Fast on purpose: a vLLM bump shows its drift here."""

from __future__ import annotations

import pytest

from vllm_loraserve.compat import CONTRACT, V2_CONTRACT, Symbol, check_symbol, contract_problems


def test_every_patched_and_read_symbol_resolves():
    problems = contract_problems() + contract_problems(V2_CONTRACT)
    assert not problems, "vLLM moved what the plugin relies on:\n" + "\n".join(problems)


@pytest.mark.parametrize("sym, message", [
    (Symbol("vllm.v1.engine.core:EngineCore.gone_method", patch=True),
     r"vllm\.v1\.engine\.core\.EngineCore\.gone_method is missing"),
    (Symbol("vllm.no_such_module:X"), r"vllm\.no_such_module cannot be imported"),
    (Symbol("vllm.v1.engine.core:EngineCore.add_lora", params=("self", "request")),
     r"EngineCore\.add_lora changed its signature: parameters \['self', 'lora_request'\]"),
    (Symbol("vllm.lora.worker_manager:WorkerLoRAManager", attrs=("_adapter_manager", "_gone")),
     r"WorkerLoRAManager no longer has \['_gone'\]"),
    (Symbol("vllm.v1.engine.core:EngineCore.__init__", calls=("not_called_here",)),
     r"EngineCore\.__init__ no longer mentions \['not_called_here'\]"),
    # inherited, not the class's own: patching it would change only the subclass
    (Symbol("vllm.engine.arg_utils:AsyncEngineArgs.from_cli_args", patch=True),
     r"AsyncEngineArgs\.from_cli_args is no longer defined on AsyncEngineArgs itself"),
])
def test_a_moved_symbol_is_named(sym, message):
    with pytest.raises(Exception, match=message):
        check_symbol(sym)


def _owner_and_name(path: str) -> tuple[str, str]:
    module, _, qual = path.partition(":")
    owner, _, name = qual.rpartition(".")
    return owner or module.rsplit(".", 1)[-1], name


def test_contract_covers_every_wrap_call():
    """Every `wrap(Owner, "name", ...)` in the package is a patch in the contract
    (cpu_ops wraps its _BGMV_OPS in two modules by loop)."""
    import pathlib
    import re

    from vllm_loraserve.worker.cpu_ops import _BGMV_OPS

    src = pathlib.Path(__file__).parents[1] / "src" / "vllm_loraserve"
    calls = {("lora_ops", op) for op in _BGMV_OPS} | {("punica_cpu", op) for op in _BGMV_OPS}
    for path in src.rglob("*.py"):
        for owner, name in re.findall(r"\bwrap\(([\w.]+), \"(\w+)\"", path.read_text()):
            calls.add((owner.rsplit(".", 1)[-1], name))
    patched = {_owner_and_name(s.path) for s in CONTRACT + V2_CONTRACT if s.patch}
    assert len(calls) >= 20 and calls <= patched, \
        f"wrap() targets not in compat.CONTRACT: {sorted(calls - patched)}"
