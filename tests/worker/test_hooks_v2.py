"""The paged pool's patches of vLLM's V2 model runner (--loraserve-model-runner
auto). V2 cannot run on this machine (vLLM's CPU platform has no V2 runner
it can start), so these check the wrapper against a stand-in for the
runner's execute_model with the real method's signature: what reaches the
original, and what the pool's manager is told, per kind of call."""

from __future__ import annotations

import contextlib
import inspect

import pytest
from vllm.config import VllmConfig
from vllm.v1.worker.gpu import model_runner as v2

from vllm_loraserve._patching import original
from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.paging.step import REPORT_ATTR, STEP_ATTR
from vllm_loraserve.worker import hooks
from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

V2_EXECUTE = original(v2.GPUModelRunner.execute_model)


class Manager(PagedWorkerLoRAManager):
    """The calls the hooks make, recorded (no pool behind them)."""

    def __init__(self, force_eager: bool = False) -> None:  # noqa: D107 (no vLLM init)
        self.calls: list[tuple] = []
        self._force = force_eager
        self.step_trace = None
        self.read_gate = None

    def apply_step(self, step, idle=False):
        self.calls.append(("apply_step", step, idle))

    def end_forward(self):
        self.calls.append(("end_forward",))

    @property
    def force_eager(self):
        return self._force

    def report(self):
        self.calls.append(("report",))
        return "the report"


class Runner:
    def __init__(self, manager) -> None:
        self.lora_manager = manager


class Output:
    pass


class SchedulerOutput:
    def __init__(self, tokens: int) -> None:
        self.total_num_scheduled_tokens = tokens
        setattr(self, STEP_ATTR, "the step")


def _stand_in(fail: bool = False):
    """execute_model with V2's signature: records how it was called."""
    seen = []

    def execute_model(*args, **kwargs):
        bound = inspect.signature(V2_EXECUTE).bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(dict(bound.arguments))
        if fail:
            raise RuntimeError("the forward pass failed")
        return Output()

    execute_model.__signature__ = inspect.signature(V2_EXECUTE)
    return hooks._make_execute_model_v2(execute_model), seen


def test_a_step_applies_the_pool_step_runs_and_reports():
    patched, seen = _stand_in()
    manager = Manager()
    out = patched(Runner(manager), SchedulerOutput(5))
    assert manager.calls == [("apply_step", "the step", False), ("end_forward",), ("report",)]
    assert getattr(out, REPORT_ATTR) == "the report"
    assert [s["is_profile"] for s in seen] == [False]


@pytest.mark.parametrize("call", [
    lambda f, r, so: f(r, so, dummy_run=True, skip_attn_for_dummy_run=True, is_profile=True),
    lambda f, r, so: f(r, so, None, True),  # dummy_run given by position
])
def test_v2s_own_dummy_runs_pass_through_untouched(call):
    """V2's profile, warm-up and data-parallel padding runs carry no step: the
    pool's host-tier bookkeeping must not see them (an apply_step(None)
    would drop the keep set of the waiting requests' adapters)."""
    patched, seen = _stand_in()
    manager = Manager()
    out = call(patched, Runner(manager), SchedulerOutput(5))
    assert manager.calls == [] and not hasattr(out, REPORT_ATTR)
    assert seen[0]["dummy_run"] is True


@pytest.mark.parametrize("positional", [False, True])
def test_a_cpu_assisted_step_runs_eagerly_through_is_profile(positional):
    patched, seen = _stand_in()
    args = (None,) if positional else ()  # intermediate_tensors by position
    patched(Runner(Manager(force_eager=True)), SchedulerOutput(5), *args)
    assert seen[0]["is_profile"] is True and seen[0]["dummy_run"] is False
    patched(Runner(Manager(force_eager=False)), SchedulerOutput(5), *args)
    assert seen[1]["is_profile"] is False


def test_the_forward_pass_ends_even_when_it_fails():
    patched, _ = _stand_in(fail=True)
    manager = Manager()
    with pytest.raises(RuntimeError, match="failed"):
        patched(Runner(manager), SchedulerOutput(5))
    assert manager.calls == [("apply_step", "the step", False), ("end_forward",)]


def test_a_token_less_step_is_idle_and_a_runner_without_the_pool_is_left_alone():
    patched, seen = _stand_in()
    manager = Manager()
    patched(Runner(manager), SchedulerOutput(0))
    assert manager.calls[0] == ("apply_step", "the step", True)
    out = patched(Runner(object()), SchedulerOutput(5))  # vLLM's own LoRA manager
    assert not hasattr(out, REPORT_ATTR) and len(seen) == 2


def test_the_pool_keeps_vllm_on_v1_unless_asked():
    hooks.install()
    assert v2.GPUModelRunner.execute_model is not V2_EXECUTE  # wrapped

    def unsupported(**loraserve):
        return VllmConfig(additional_config={"loraserve": loraserve}) \
            ._get_v2_model_runner_unsupported_features()

    assert any("loraserve" in f for f in unsupported())
    assert any("loraserve" in f for f in unsupported(model_runner="v1"))
    assert not any("loraserve" in f for f in unsupported(model_runner="auto"))
    assert not any("loraserve" in f for f in unsupported(pool="vllm"))


def test_is_profile_is_read_only_for_the_eager_switch():
    """The wrapper sets is_profile to run a CPU-assisted step eagerly; that is
    all it may do in V2 (the signature and `need_eager=is_profile or ...`)."""
    assert inspect.getsource(V2_EXECUTE).count("is_profile") == 2


@contextlib.contextmanager
def _logged(caplog):
    """caplog sees hooks' log (vLLM's loggers do not propagate to it)."""
    hooks.logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        hooks.logger.removeHandler(caplog.handler)


class KVManager(Manager):
    def __init__(self, model_runner: str) -> None:
        super().__init__()
        self.cfg = LoraServeConfig(model_runner=model_runner)

    def bind_kv_cache(self, kv_caches):
        self.calls.append(("bind", kv_caches))


def test_v2_binds_the_pool_only_when_asked(caplog):
    """vLLM may take V2 before it asks what V2 lacks (VLLM_USE_V2_MODEL_RUNNER,
    some speculative methods): with model_runner v1 the pool refuses to start
    there; with auto it binds, and says it is experimental."""
    bound = []
    init = hooks._make_initialize_kv_cache(lambda self, cfg: bound.append(cfg), "V2")
    runner = Runner(KVManager("v1"))
    runner.kv_caches = ["layer 0"]
    with pytest.raises(ValueError, match="chose its V2 model runner"):
        init(runner, "kv config")
    assert bound == [] and runner.lora_manager.calls == []
    runner.lora_manager = KVManager("auto")
    with _logged(caplog):
        init(runner, "kv config")
    assert bound == ["kv config"] and runner.lora_manager.calls == [("bind", ["layer 0"])]
    assert "experimental, slower than" in caplog.text


def test_a_moved_v2_leaves_the_pool_on_v1(monkeypatch, caplog):
    """A vLLM whose V2 runner moved keeps serving the default (V1), says so,
    and refuses `auto` with the reason."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_loraserve import compat
    from vllm_loraserve.frontend import args

    monkeypatch.setattr(compat, "V2_CONTRACT",
                        (compat.Symbol(f"{compat._V2}.gone", patch=True),))
    with _logged(caplog):
        hooks.install()
    assert "the pool runs on V1 only" in caplog.text and "gone is missing" in caplog.text
    with pytest.raises(ValueError, match="V2 model runner is not the one.*gone is missing"):
        args.activate(EngineArgs(model="m", enable_lora=True,
                                 additional_config={"loraserve": {"model_runner": "auto"}}))
    args.activate(EngineArgs(model="m", enable_lora=True, additional_config={"loraserve": {}}))
