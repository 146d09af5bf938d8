"""Triton kernels run on the CPU under Triton's interpreter: tests/conftest.py
sets TRITON_INTERPRET=1 before any test module imports triton."""
