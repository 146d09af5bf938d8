"""Fine-tuning many LoRA adapters of different ranks at once (ALoRA, seed
002 in ../shared/papers): mixed batches through the paged kernels' backward,
per-adapter optimizers and accumulation, inference samples in the same
batch, new versions published to running servers.

Data path: config (train.json) -> data (JSONL -> token ids) -> mixed
(samples -> one padded batch and its per-token adapter mapping) -> lora (the
autograd Function over the kernels, the wrapped nn.Linear layers) ->
trainer (steps, optimizers, inference) -> publish (PEFT dirs, server loads).
"""
