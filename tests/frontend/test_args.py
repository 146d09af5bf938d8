"""`vllm serve --plugin loraserve --loraserve-*`: parsing and activation,
through vLLM's own serve parser and EngineArgs."""

from __future__ import annotations

import logging
import subprocess

import pytest

from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.frontend import args as cli
from vllm_loraserve.process import vllm_executable


@pytest.fixture(scope="module")
def serve_parser():
    from vllm_loraserve.plugin import install

    install()
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _engine_args(parser, argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def test_flags_reach_additional_config(serve_parser, tmp_path):
    ea = _engine_args(serve_parser, ["m", "--plugin", "loraserve", "--enable-lora",
                                     "--loraserve-adapter-dir", str(tmp_path),
                                     "--loraserve-adapter-dir", "/x"])
    assert ea.additional_config["loraserve"] == {"adapter_dirs": [str(tmp_path), "/x"]}


def test_cold_start_flags(serve_parser):
    ea = _engine_args(serve_parser, ["m", "--plugin", "loraserve", "--enable-lora",
                                     "--loraserve-cold-start", "cpu-assist",
                                     "--loraserve-cold-start-group-layers", "2"])
    assert ea.additional_config["loraserve"] == {"cold_start": "cpu-assist",
                                                 "cold_start_group_layers": 2}
    assert LoraServeConfig().cold_start == "auto"  # resolved per device: worker/cold_start.py
    with pytest.raises(SystemExit):
        serve_parser.parse_args(["m", "--plugin", "loraserve", "--loraserve-cold-start", "eager"])
    with pytest.raises(ValueError, match="cold_start_group_layers must be an integer >= 1"):
        LoraServeConfig(cold_start_group_layers=0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def parser_log(serve_parser):
    """What vLLM's argument parser logs (its logger does not propagate)."""
    log = logging.getLogger(type(serve_parser).__module__)
    records = _Records()
    log.addHandler(records)
    yield records.messages
    log.removeHandler(records)


def test_repeated_dir_flags_are_no_duplicates(serve_parser, parser_log, tmp_path):
    """The README repeats --loraserve-adapter-dir; vLLM's parser warned about
    it (Found duplicate keys). Other duplicates still get the warning."""
    argv = ["m", "--plugin", "loraserve", "--enable-lora",
            "--loraserve-adapter-dir", "/a", "--loraserve-adapter-dir", "/b",
            "--loraserve-allowed-root", "/c", "--loraserve-allowed-root", "/d"]
    ea = _engine_args(serve_parser, argv)
    assert ea.additional_config["loraserve"] == {"adapter_dirs": ["/a", "/b"],
                                                 "allowed_roots": ["/c", "/d"]}
    assert not [m for m in parser_log if "duplicate" in m]
    _engine_args(serve_parser, [*argv, "--max-model-len", "64", "--max-model-len", "128"])
    assert [m for m in parser_log if "duplicate" in m] == ["Found duplicate keys --max-model-len"]


def test_help_shows_the_plugin_flags():
    """Plain --help of `vllm serve` lists group titles only; with the plugin
    requested it also shows the loraserve flags, under the group's title."""
    out = subprocess.run([vllm_executable(), "serve", "--plugin", "loraserve", "--help"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    section = out[out.index("\nvllm-loraserve:\n"):]
    for flag in ("--plugin NAME", "--loraserve-adapter-dir", "--loraserve-pool {paged,vllm}"):
        assert flag in section
    assert section.index("--loraserve-adapter-dir") < section.index("For full list:")


def test_without_plugin_nothing_changes(serve_parser):
    ea = _engine_args(serve_parser, ["m", "--enable-lora"])
    assert "loraserve" not in (ea.additional_config or {})
    assert not ea.worker_extension_cls


def test_flags_merge_over_additional_config(serve_parser):
    ea = _engine_args(serve_parser, [
        "m", "--plugin", "loraserve", "--additional-config",
        '{"loraserve": {"adapter_dirs": ["/a"]}, "other": 1}',
        "--loraserve-adapter-dir", "/b"])
    assert ea.additional_config == {"loraserve": {"adapter_dirs": ["/b"]}, "other": 1}


def test_loraserve_flag_without_plugin_is_an_error(serve_parser):
    with pytest.raises(ValueError, match="need --plugin loraserve"):
        _engine_args(serve_parser, ["m", "--loraserve-adapter-dir", "/a"])


def test_unknown_plugin_is_an_error(serve_parser):
    with pytest.raises(ValueError, match=r"unknown --plugin \['other'\]"):
        _engine_args(serve_parser, ["m", "--plugin", "other"])


def _activate(**kw):
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(model="m", **kw)
    cli.activate(ea)
    return ea


def test_activate_wires_worker_extension(tmp_path):
    ea = _activate(enable_lora=True,
                   additional_config={"loraserve": {"adapter_dirs": [str(tmp_path)]}})
    assert ea.worker_extension_cls == cli.WORKER_EXTENSION
    assert cli.active_config().adapter_dirs == [str(tmp_path)]


@pytest.mark.parametrize("kw, message", [
    ({"enable_lora": False, "additional_config": {"loraserve": {}}}, "add --enable-lora"),
    ({"enable_lora": True, "additional_config": {"loraserve": {"adapter_dirs": ["/no/such"]}}},
     "not a directory"),
    ({"enable_lora": True, "additional_config": {"loraserve": {"bogus": 1}}},
     r"unknown loraserve option\(s\) \['bogus'\]"),
    ({"enable_lora": True, "worker_extension_cls": "my.Ext",
      "additional_config": {"loraserve": {}}}, "cannot be combined with my.Ext"),
])
def test_activate_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        _activate(**kw)


@pytest.mark.parametrize("var, value, message", [
    ("VLLM_USE_V2_MODEL_RUNNER", "1", "V1 model runner"),
    ("VLLM_LORA_ENABLE_DUAL_STREAM", "1", "unset VLLM_LORA_ENABLE_DUAL_STREAM"),
])
def test_activate_refuses_vllm_modes_the_pool_does_not_run(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        _activate(enable_lora=True, additional_config={"loraserve": {}})
    # vLLM's own slots run them
    _activate(enable_lora=True, additional_config={"loraserve": {"pool": "vllm"}})


def test_the_v2_runner_is_opt_in(monkeypatch, caplog):
    """--loraserve-model-runner auto lets vLLM's V2 runner serve the pool
    (experimental: said at start-up), without data parallelism, speculative
    decoding or V2's breakable graphs, which the pool has not run with on V2."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cli.logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to caplog's
    try:
        _activate(enable_lora=True, additional_config={"loraserve": {"model_runner": "auto"}})
    finally:
        cli.logger.removeHandler(caplog.handler)
    assert "experimental, slower than" in caplog.text
    for kw in ({"data_parallel_size": 2}, {"speculative_config": {"method": "ngram"}}):
        with pytest.raises(ValueError, match="does not support data parallelism, speculative"):
            _activate(enable_lora=True, additional_config={"loraserve": {"model_runner": "auto"}},
                      **kw)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(ValueError, match="VLLM_USE_BREAKABLE_CUDAGRAPH"):
        _activate(enable_lora=True, additional_config={"loraserve": {"model_runner": "auto"}})


def test_unsupported_vllm_version_refuses():
    from vllm_loraserve.compat import UnsupportedVLLMVersion, check_supported

    assert check_supported("0.26.3") == "0.26.3"
    assert check_supported("0.27.0+cpu") == "0.27.0+cpu"
    for v in ("0.25.1", "0.28.0", "dev"):
        with pytest.raises(UnsupportedVLLMVersion, match=r"supports vLLM 0\.26\.x or 0\.27\.x"):
            check_supported(v)


def test_register_on_unsupported_vllm(monkeypatch):
    """--plugin loraserve on an unsupported vLLM stops with the reason;
    otherwise the plugin stays out of the way."""
    import vllm

    from vllm_loraserve import plugin

    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--plugin", "loraserve"])
    with pytest.raises(SystemExit, match="0.30.0"):
        plugin.register()
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m"])
    plugin.register()  # logs, raises nothing


def test_register_is_idempotent(serve_parser, monkeypatch):
    """vLLM may load general plugins more than once per process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from vllm_loraserve._patching import original
    from vllm_loraserve.plugin import register

    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--plugin", "loraserve"])
    before = [EngineArgs.__dict__["from_cli_args"].__func__,
              LoRAModelRunnerMixin.__dict__["load_lora_model"]]
    register()
    register()
    after = [EngineArgs.__dict__["from_cli_args"].__func__,
             LoRAModelRunnerMixin.__dict__["load_lora_model"]]
    assert after == before
    assert all(original(f) is not f and original(original(f)) is original(f) for f in after)
