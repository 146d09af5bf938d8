"""One in-process engine whose scheduler admits requests before their
adapters are read and whose workers read nothing ahead: every adapter of a
step is read on the engine thread, inside the step (otherwise as
vllm_generate.py). With a host tier smaller than a step's adapters, that
step must load some adapters before it reads the others.

    python cold_reads.py spec.json out.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    from vllm_loraserve.scheduler.scheduler import PoolSchedulerMixin
    from vllm_loraserve.worker.host_tier import HostTier

    PoolSchedulerMixin._ready = lambda self, lora_id: True
    HostTier.prefetch = lambda self, request, nbytes: False

    from vllm_generate import main as generate

    generate()


if __name__ == "__main__":
    main()
