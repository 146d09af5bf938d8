"""CPU workers for cold adapters' LoRA deltas (Toppings §4, issue 24 item 4).

pool.py       CpuWorkerPool: the engine's side (jobs, waits, failures, the stream path)
proc.py       one worker process (python -m ...proc): pinned core, polls, computes its rows
control.py    the control segment's layout: flags, job descriptors, error messages
shm.py        SharedSegment (memfd, pinnable) and SharedChunks (an arena in segments)
doorbell.py   eventfd semaphores that wake workers and the engine
split.py      the start-up profile and the rows each worker takes
cores.py      which cores the workers take (the default's rule)

Nothing is imported here: `python -m vllm_loraserve.worker.cpu_lora.proc`
must not find proc.py imported already.
"""
