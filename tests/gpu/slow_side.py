"""tests/e2e/vllm_generate.py with every step's layer-group page loads held
back on the side stream (`delay_cycles` of torch.cuda._sleep queued before
them), so a pipelined layer really spins on its group's flag and a
cpu-assist layer really finds its group not landed.

    python slow_side.py spec.json out.json

spec: as vllm_generate.py, plus "delay_cycles".
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))


def main() -> None:
    import torch

    from vllm_loraserve.worker import load_lane

    cycles = json.load(open(sys.argv[1]))["delay_cycles"]
    start = load_lane.StreamLane.start

    def delayed(self):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)
        start(self)

    load_lane.StreamLane.start = delayed

    from vllm_generate import main as generate

    generate()


if __name__ == "__main__":
    main()
