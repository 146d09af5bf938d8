"""`vllm serve ... --plugin loraserve --loraserve-*`: command line to config.

vLLM has no `--plugin` flag, but `AsyncEngineArgs.add_cli_args` loads
general plugins before it calls `EngineArgs.add_cli_args`
(vllm/engine/arg_utils.py), so wrapping the latter adds our flags to the
`vllm serve` parser. `EngineArgs.from_cli_args` then moves them into
`additional_config["loraserve"]`, which travels inside `VllmConfig` to the
engine core and every worker. `EngineArgs.create_engine_config` is where the
plugin activates, for the CLI and for Python users alike.

vLLM's parser (`FlexibleArgumentParser`, vllm/utils/argparse_utils.py) shows
only group titles under plain `--help`, and warns about any flag given twice;
`add_arguments` makes it show our group's flags and accept our repeatable
ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

from vllm_loraserve._patching import wrap
from vllm_loraserve.config import ADDITIONAL_CONFIG_KEY, LoraServeConfig

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format

PLUGIN_NAME = "loraserve"
WORKER_EXTENSION = "vllm_loraserve.worker.extension.LoraServeWorkerExtension"
POOL_SCHEDULER = "vllm_loraserve.scheduler.scheduler.make_scheduler"

_active: LoraServeConfig | None = None


def active_config() -> LoraServeConfig | None:
    """The plugin config of the engine built in this process, if active."""
    return _active


def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(LoraServeConfig) if "flag" in f.metadata]


def _dest(f: dataclasses.Field) -> str:
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def _repeatable_flags() -> frozenset[str]:
    return frozenset(f.metadata["flag"] for f in _flag_fields()
                     if f.metadata.get("action") == "append")


class _RepeatableFlags(logging.Filter):
    """Drops our repeatable flags from vLLM's "Found duplicate keys" warning
    (`FlexibleArgumentParser.parse_args` counts every flag given twice);
    other duplicates are still reported."""

    MESSAGE = "Found duplicate keys %s"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE or len(record.args or ()) != 1:
            return True
        keys = [k for k in str(record.args[0]).split(", ") if k not in _repeatable_flags()]
        record.args = (", ".join(keys),)
        return bool(keys)


def _accept_repeated_flags(parser: argparse.ArgumentParser) -> None:
    log = logging.getLogger(type(parser).__module__)
    if not any(isinstance(f, _RepeatableFlags) for f in log.filters):
        log.addFilter(_RepeatableFlags())


def _show_in_help(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
    """Plain `--help` of vLLM's parser lists group titles only (its
    `format_help`); someone who typed `--plugin loraserve --help` gets this
    group's flags too, before the epilog. `--help=<group|flag|all>` is vLLM's."""
    format_help = parser.format_help

    def with_group() -> str:
        if getattr(parser, "_search_keyword", None) is not None:
            return format_help()
        epilog, parser.epilog = parser.epilog, None
        try:
            text = format_help()
        finally:
            parser.epilog = epilog
        formatter = parser._get_formatter()
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
        formatter.add_text(epilog)
        return f"{text}\n{formatter.format_help()}"

    parser.format_help = with_group  # this parser only


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    group = parser.add_argument_group(
        "vllm-loraserve", "Options of the loraserve plugin (need --plugin loraserve)."
    )
    group.add_argument(
        "--plugin",
        action="append",
        default=None,
        metavar="NAME",
        help="Activate an installed vLLM plugin by name. 'loraserve' turns on "
        "vllm-loraserve. Repeatable.",
    )
    for f in _flag_fields():
        kind = f.metadata.get("action")
        extra: dict[str, Any] = {"action": kind} if kind else {"type": type(f.default)}
        if "choices" in f.metadata:
            extra["choices"] = f.metadata["choices"]
        group.add_argument(f.metadata["flag"], dest=_dest(f), default=None,
                           help=f.metadata["help"], **extra)
    if isinstance(parser, FlexibleArgumentParser):
        _show_in_help(parser, group)
        _accept_repeated_flags(parser)


def config_from_args(
    args: argparse.Namespace, base: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The `additional_config["loraserve"]` dict the command line asks for.

    Flags given on the command line override the same keys of an
    `--additional-config '{"loraserve": {...}}'`. Returns None when the plugin
    is not requested; raises when loraserve flags come without the plugin.
    """
    plugins = getattr(args, "plugin", None) or []
    unknown = sorted(set(plugins) - {PLUGIN_NAME})
    if unknown:
        raise ValueError(f"unknown --plugin {unknown}; installed: ['{PLUGIN_NAME}']")
    given = {f.name: getattr(args, _dest(f)) for f in _flag_fields()
             if getattr(args, _dest(f), None) is not None}
    if PLUGIN_NAME not in plugins:
        if given:
            flags = [f.metadata["flag"] for f in _flag_fields() if f.name in given]
            raise ValueError(f"{flags} need --plugin {PLUGIN_NAME}")
        return None
    return {**(base or {}), **given}


def activate(engine_args: Any) -> None:
    """Validate the plugin config of `engine_args` and wire the engine for it.

    Runs in the process that builds the engine config (API server or LLM).
    """
    from vllm_loraserve.compat import check_supported

    global _active
    check_supported()
    cfg = LoraServeConfig.from_dict(engine_args.additional_config[ADDITIONAL_CONFIG_KEY])
    if not engine_args.enable_lora:
        raise ValueError("vllm-loraserve serves LoRA adapters: add --enable-lora")
    for flag, dirs in (("--loraserve-adapter-dir", cfg.adapter_dirs),
                       ("--loraserve-allowed-root", cfg.allowed_roots)):
        missing = [d for d in dirs if not os.path.isdir(d)]
        if missing:
            raise ValueError(f"{flag}: not a directory: {missing}")
    cfg.adapter_dirs = [os.path.abspath(d) for d in cfg.adapter_dirs]
    cfg.allowed_roots = [os.path.abspath(d) for d in cfg.allowed_roots]
    ext = engine_args.worker_extension_cls
    if ext and ext != WORKER_EXTENSION:
        raise ValueError(
            f"vllm-loraserve needs --worker-extension-cls {WORKER_EXTENSION}; "
            f"it cannot be combined with {ext}"
        )
    engine_args.worker_extension_cls = WORKER_EXTENSION
    if cfg.pool == "paged":
        sched = engine_args.scheduler_cls
        if sched and sched != POOL_SCHEDULER:
            raise ValueError(f"the loraserve pool needs --scheduler-cls {POOL_SCHEDULER}; it "
                             f"cannot be combined with {sched} (or use --loraserve-pool vllm)")
        engine_args.scheduler_cls = POOL_SCHEDULER
        if cfg.model_runner == "v1" and \
                os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
            raise ValueError("the loraserve pool runs on vLLM's V1 model runner: unset "
                             "VLLM_USE_V2_MODEL_RUNNER (or pass --loraserve-model-runner "
                             "auto, experimental)")
        if cfg.model_runner == "auto":
            from vllm_loraserve.compat import V2_CONTRACT, contract_problems

            problems = contract_problems(V2_CONTRACT)
            if problems:
                raise ValueError("--loraserve-model-runner auto: this vLLM's V2 model runner "
                                 "is not the one the plugin was written for: "
                                 + "; ".join(problems))
            # V2 runs dummy batches through execute_model while serving under
            # data parallelism, and its speculator after the forward pass;
            # breakable graphs are V2's own: paths the pool has not run on.
            if (engine_args.data_parallel_size or 1) > 1 or engine_args.speculative_config or \
                    os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") not in ("", "0"):
                raise ValueError("--loraserve-model-runner auto does not support data "
                                 "parallelism, speculative decoding or "
                                 "VLLM_USE_BREAKABLE_CUDAGRAPH yet")
            logger.warning("vllm-loraserve: --loraserve-model-runner auto lets vLLM pick "
                           "its V2 runner for the paged pool: experimental, slower than "
                           "V1 with many adapters (docs/benchmarks/e2e.md, session 33)")
        if os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM", "0").strip() not in ("", "0"):
            # vLLM would then run each LoRA layer inside an op of its own, on a
            # second stream beside the base GEMM: a path the pool's buffers were
            # never tested on, and slower with its kernels from 256 tokens on
            # (docs/benchmarks/kernels.md, session 34).
            raise ValueError("the loraserve pool runs LoRA on the model's stream: unset "
                             "VLLM_LORA_ENABLE_DUAL_STREAM (or use --loraserve-pool vllm)")
    engine_args.additional_config[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    _active = cfg
    logger.info("vllm-loraserve active: %s", cfg)


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make_add_cli_args(add_cli_args):
        def patched(parser, *a, **kw):
            parser = add_cli_args(parser, *a, **kw)
            add_arguments(parser)
            return parser

        return patched

    def make_from_cli_args(from_cli_args):
        def patched(cls, args):
            engine_args = from_cli_args(cls, args)
            extra = dict(engine_args.additional_config or {})
            cfg = config_from_args(args, extra.get(ADDITIONAL_CONFIG_KEY))
            if cfg is not None:
                extra[ADDITIONAL_CONFIG_KEY] = cfg
                engine_args.additional_config = extra
            return engine_args

        return patched

    def make_create_engine_config(create_engine_config):
        def patched(self, *a, **kw):
            if ADDITIONAL_CONFIG_KEY in (self.additional_config or {}):
                activate(self)
            return create_engine_config(self, *a, **kw)

        return patched

    wrap(EngineArgs, "add_cli_args", make_add_cli_args)
    wrap(EngineArgs, "from_cli_args", make_from_cli_args)
    wrap(EngineArgs, "create_engine_config", make_create_engine_config)
