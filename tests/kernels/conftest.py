"""Triton kernels run on the CPU under Triton's interpreter. The variable must
be set before the kernels module is imported (triton.jit reads it then)."""

import os

os.environ["TRITON_INTERPRET"] = "1"
