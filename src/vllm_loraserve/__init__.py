"""vllm-loraserve: vLLM plugins for serving many LoRA adapters of different ranks.

The package is loaded by vLLM through entry points (see pyproject.toml); nothing
here imports vLLM at module import time, so `import vllm_loraserve` is cheap.
"""

__version__ = "0.1.0"
