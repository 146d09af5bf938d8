"""One in-process engine where one adapter's load fails at a chosen stage,
with an exception no adapter check raises; otherwise as vllm_generate.py.

    python faulty_load.py spec.json out.json

spec: as vllm_generate.py, plus "faults": {adapter name: stage}, stage one of
"read" (reading its files), "deleted" (its directory removed just before the
worker reads it: after start-up and the scheduler's checks), "pack" (packing
its pages on the device), "write" (writing its pages, after its slot's table
row was written; with --loraserve-cold-start pipelined or cpu-assist, its
second layer group's, after the first group's pages).
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))


class InjectedFault(Exception):
    pass


def main() -> None:
    from vllm_loraserve.worker import paged_manager
    from vllm_loraserve.worker.pool import DevicePool

    spec = json.load(open(sys.argv[1]))
    faults = spec["faults"]
    paths = {r["lora_path"]: r["lora_name"] for r in spec["requests"] if r["lora_name"]}
    # vllm_generate.py numbers adapters from 1 in order of first appearance.
    names = dict(enumerate(dict.fromkeys(
        r["lora_name"] for r in spec["requests"] if r["lora_name"]), start=1))

    def failing(stage, name):
        if faults.get(name) == stage:
            raise InjectedFault(f"injected at {stage} for {name}")

    read_weights = paged_manager.read_weights
    device_streams = paged_manager.PagedWorkerLoRAManager._device_streams
    load, write_group = DevicePool.load, DevicePool.write_group

    def read(path, alloc, *args):
        failing("read", paths.get(path))
        if faults.get(paths.get(path)) == "deleted":
            shutil.rmtree(path)
        return read_weights(path, alloc, *args)

    def pack(self, entry, *args):
        failing("pack", entry.name)
        return device_streams(self, entry, *args)

    def write(self, slot, lora_id, placement, page_ids, streams):
        if faults.get(names.get(lora_id)) == "write":
            self.table.write(slot, placement, page_ids)  # a half-done write
            failing("write", names[lora_id])
        return load(self, slot, lora_id, placement, page_ids, streams)

    def write_in_groups(self, slot, group, streams):
        if group == 1:
            failing("write", names.get(self.slots[slot].lora_id))
        return write_group(self, slot, group, streams)

    paged_manager.read_weights = read
    paged_manager.PagedWorkerLoRAManager._device_streams = pack
    DevicePool.load = write
    DevicePool.write_group = write_in_groups

    from vllm_generate import main as generate

    generate()


if __name__ == "__main__":
    main()
