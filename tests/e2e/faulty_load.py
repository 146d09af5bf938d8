"""One in-process engine where one adapter's load fails at a chosen stage,
with an exception no adapter check raises; otherwise as vllm_generate.py.

    python faulty_load.py spec.json out.json

spec: as vllm_generate.py, plus "faults": {adapter name: stage}, stage one of
"read" (reading its files), "deleted" (its directory removed just before the
worker reads it: after start-up and the scheduler's checks), "pack" (packing
its pages on the device), "write" (writing its pages, after its slot's table
row was written; with --loraserve-cold-start pipelined or cpu-assist, its
second layer group's, after the first group's pages), or "read-eio-once" /
"pack-oom-once": its first read raises OSError(EIO) / its first packing
CUDA's OutOfMemoryError (transient: a later request loads it again; spec
"again": true runs the requests twice, see vllm_generate.py). With "assist_victim"
(a file path), the first adapter without another fault whose CPU deltas are
enqueued (cpu-assist, sync-free) has every job of them failed by the
workers, and its name is written to that file.
"""

import errno
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))


class InjectedFault(Exception):
    pass


def fail_cpu_deltas(victim_file: str, spared: set[str]) -> None:
    """The first adapter with enqueued CPU deltas: its weights' jobs get a
    descriptor pointing outside every segment, so the workers fail them."""
    from vllm_loraserve.worker.cold_start import ColdStart
    from vllm_loraserve.worker.cpu_lora.pool import CpuWorkerPool

    victim: dict = {}
    slices, post = ColdStart._slices, CpuWorkerPool.post

    def marked(self, cold, layer, module):
        if not victim and self.enqueues and cold.entry.name not in spared:
            victim.update(name=cold.entry.name, a=set())
            with open(victim_file, "w") as f:
                f.write(cold.entry.name)
        for col, (a, b) in slices(self, cold, layer, module):
            if cold.entry.name == victim.get("name"):
                victim["a"].add(a.data_ptr())
            yield col, (a, b)

    def failing_post(self, n, x_dtype, a, bt, *args, **kw):
        job = post(self, n, x_dtype, a, bt, *args, **kw)
        if a.data_ptr() in victim.get("a", ()):
            self.ctl.jobs[job % self.layout.depth]["a_off"] = 1 << 40
        return job

    ColdStart._slices = marked
    CpuWorkerPool.post = failing_post


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

    import torch

    once = {"read-eio-once": lambda name: OSError(errno.EIO, f"injected EIO for {name}"),
            "pack-oom-once": lambda name: torch.cuda.OutOfMemoryError(f"injected OOM for {name}")}
    failed_once = set()

    def failing_once(stage, name):
        if faults.get(name) == stage and name not in failed_once:
            failed_once.add(name)
            raise once[stage](name)

    read_weights = paged_manager.read_weights
    device_streams = paged_manager.PagedWorkerLoRAManager._device_streams
    load, write_group = DevicePool.load, DevicePool.write_group

    def read(path, alloc, *args, **kwargs):
        failing("read", paths.get(path))
        failing_once("read-eio-once", paths.get(path))
        if faults.get(paths.get(path)) == "deleted":
            shutil.rmtree(path)
        return read_weights(path, alloc, *args, **kwargs)

    def pack(self, entry, *args):
        failing("pack", entry.name)
        failing_once("pack-oom-once", entry.name)
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
    if spec.get("assist_victim"):
        fail_cpu_deltas(spec["assist_victim"], set(faults))

    from vllm_generate import main as generate

    generate()


if __name__ == "__main__":
    main()
