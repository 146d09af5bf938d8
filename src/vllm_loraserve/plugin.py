"""`vllm.general_plugins` entry point: runs in every vLLM process.

vLLM calls `register()` in the API server (while it builds the `vllm serve`
parser, before arguments are parsed), in the engine core and in every worker.
It installs version-checked, idempotent patches that stay dormant unless the
engine's config carries `additional_config["loraserve"]` (see config.py).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format


def _requested_on_command_line(argv: list[str]) -> bool:
    return any(
        (a == "--plugin" and argv[i + 1 : i + 2] == ["loraserve"]) or a == "--plugin=loraserve"
        for i, a in enumerate(argv)
    )


def register() -> None:
    from vllm_loraserve.compat import UnsupportedVLLMVersion, check_supported

    try:
        check_supported()
    except UnsupportedVLLMVersion as e:
        if _requested_on_command_line(sys.argv):
            raise SystemExit(str(e)) from None
        logger.warning("%s", e)
        return

    from vllm_loraserve.frontend import args, endpoint
    from vllm_loraserve.scheduler import scheduler
    from vllm_loraserve.worker import hooks, rendezvous

    args.install()
    endpoint.install_gate()
    scheduler.install()
    hooks.install()
    rendezvous.install()
