import pytest


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """The kernel tests' TRITON_INTERPRET=1 must not reach vLLM processes
    started here: vLLM would take the interpreter for a Triton GPU driver."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
