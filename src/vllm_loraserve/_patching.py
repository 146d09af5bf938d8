"""Idempotent monkeypatching.

vLLM loads general plugins once per process, but a process may import this
package twice (API server parser + engine args), and tests reload it. Every
patch therefore goes through `wrap`, which marks the replacement and refuses
to wrap a function twice. A target that is missing raises PatchTargetMissing
(naming it), never a bare KeyError or AttributeError.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "__loraserve_original__"


class PatchTargetMissing(RuntimeError):
    """A function the plugin patches is not where this vLLM was expected to have it."""


def _qualname(owner: Any, name: str) -> str:
    prefix = getattr(owner, "__module__", None) if isinstance(owner, type) else None
    return ".".join(p for p in (prefix, getattr(owner, "__qualname__", None)
                                or getattr(owner, "__name__", repr(owner)), name) if p)


def wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace `owner.name` by `make(original)` unless already replaced.

    Static and class methods keep their descriptor kind, and the replacement
    carries the original's name and signature. Returns True when the
    patch was installed now, False when it was already in place. A class
    attribute must be the class's own (patching an inherited one would change
    the base class's behaviour only for this subclass, silently).
    """
    if isinstance(owner, type):
        raw = owner.__dict__.get(name)
    else:
        raw = getattr(owner, name, None)
    if raw is None or not callable(getattr(raw, "__func__", raw)):
        raise PatchTargetMissing(f"{_qualname(owner, name)} is missing or not a function")
    kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
    func = raw.__func__ if kind else raw
    if getattr(func, _MARK, None) is not None:
        return False
    # The replacement looks like the original (name, signature, annotations):
    # vLLM reads signatures, e.g. to decode utility-call arguments (EngineCore).
    replacement = functools.update_wrapper(make(func), func)
    setattr(replacement, _MARK, func)
    setattr(owner, name, kind(replacement) if kind else replacement)
    return True


def original(func: Any) -> Any:
    """The function a patch replaced (or `func` itself when unpatched)."""
    func = getattr(func, "__func__", func)
    return getattr(func, _MARK, func)


class overlay:  # noqa: N801 (reads like a function at call sites)
    """`obj` with some attributes replaced, every other one read through.

    For handing a vLLM config to vLLM code with one value changed, without
    copying (and re-validating) the config or changing it for everyone else.
    """

    def __init__(self, obj: Any, **attrs: Any) -> None:
        self.__dict__.update(attrs)
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)
