"""An engine's local adapter store: the adapters this engine holds, as PEFT
directories under one root (LoRAServe's per-engine share of the distributed
adapter pool). vLLM loads from here; peers fetch from here.

Invariant: a name is a plain directory name (no separators, adapters/safety.py),
so a name from the network can never address a path outside the root, and
an adapter whose files resolve outside the root (a symlink) is never sent.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Sequence

from vllm_loraserve.adapters.safety import check_name, resolve_adapter_under_roots


class AdapterStore:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, check_name(name))

    def has(self, name: str) -> bool:
        return os.path.isdir(self.path(name))

    def names(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root) if os.path.isdir(os.path.join(self.root, n)))

    def tar(self, name: str) -> bytes:
        """The adapter's files as an uncompressed tar (safetensors do not compress)."""
        if not self.has(name):
            raise KeyError(f"adapter {name!r} is not in this store")
        path = resolve_adapter_under_roots(self.path(name), [self.root])
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(path, arcname=name)
        return buf.getvalue()

    def put_tar(self, name: str, data: bytes) -> None:
        """Unpack an adapter atomically (a reader never sees half of it)."""
        final = self.path(name)
        tmp = os.path.join(self.root, f".incoming-{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
            members = tf.getmembers()
            if not members or any(not (m.name == name or m.name.startswith(name + "/"))
                                  for m in members):
                raise ValueError(f"archive for {name!r} holds other paths")
            tf.extractall(tmp, filter="data")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(os.path.join(tmp, name), final)
        shutil.rmtree(tmp, ignore_errors=True)

    def put_files(self, name: str, files: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Write an adapter from (relative path, bytes) pairs atomically, as
        `put_tar`; a path that would leave the adapter's directory is refused
        before anything is written."""
        tmp = os.path.join(self.root, f".incoming-{name}")
        targets = []
        for rel, data in files:
            full = os.path.normpath(os.path.join(tmp, rel))
            if os.path.isabs(rel) or not full.startswith(tmp + os.sep):
                raise ValueError(f"a file of {name!r} lies outside it: {rel!r}")
            targets.append((full, data))
        if not targets:
            raise ValueError(f"no files for {name!r}")
        final = self.path(name)
        shutil.rmtree(tmp, ignore_errors=True)
        for full, data in targets:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def copy_in(self, name: str, src: str) -> None:
        shutil.copytree(src, self.path(name), dirs_exist_ok=True)

    def remove(self, name: str) -> None:
        shutil.rmtree(self.path(name), ignore_errors=True)

    def size_bytes(self, name: str) -> int:
        return sum(os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(self.path(name)) for f in files)
