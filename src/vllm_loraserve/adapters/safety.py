"""What a client may call an adapter and where it may point the server.

Adapter names come from the network (`/v1/load_lora_adapter`, the router's
`POST /admin/adapters`) and end up in paths, logs and metric labels; adapter
paths from the network are read by the server. Both are checked here, by the
plugin server and the router alike:
- a name is a plain identifier: letters, digits, `.`, `_`, `-`, starting
  with a letter or digit, optionally followed by one `@version` of the same
  characters (`name@step`, a published training version), at most 200
  characters (so no path separator, `..` or control character), and not a
  served base model's name;
- a path must resolve (symlinks and `..` followed) inside one of the
  configured adapter roots; the server shows paths relative to their root.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection

MAX_NAME_LENGTH = 200
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class PathOutsideRoots(ValueError):
    """A path that resolves outside every adapter root (HTTP 403)."""


def check_name(name: object, reserved: Collection[str] = ()) -> str:
    """`name` if it is a safe adapter name, else ValueError saying why."""
    if not isinstance(name, str) or not name:
        raise ValueError("invalid adapter name: give a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"invalid adapter name of {len(name)} characters: at most "
                         f"{MAX_NAME_LENGTH} are allowed")
    if not _NAME.match(name):
        raise ValueError(f"invalid adapter name {name!r}: use letters, digits, '.', '_' and "
                         "'-', starting with a letter or digit, and at most one '@version'")
    if name in reserved:
        raise ValueError(f"invalid adapter name {name!r}: it is the name of a served base "
                         "model")
    return name


def alias_of(name: str) -> str:
    """The name a published version `name@version` is served under as an
    alias (`name`); a plain name is its own."""
    return name.partition("@")[0]


def resolve_under_roots(path: str, roots: Collection[str]) -> str:
    """The real path of `path` if it lies inside one of `roots` (each
    resolved too), else PathOutsideRoots naming the roots."""
    if not roots:
        raise PathOutsideRoots(
            f"adapter path {path!r} refused: no adapter root is configured for loads over "
            "HTTP (--loraserve-adapter-dir or --loraserve-allowed-root)")
    real = os.path.realpath(path)
    for root in roots:
        root = os.path.realpath(root)
        if os.path.commonpath([real, root]) == root:
            return real
    raise PathOutsideRoots(f"adapter path {path!r} (resolved: {real}) is outside the adapter "
                           f"roots {sorted(roots)}")


def shown_path(path: str, roots: Collection[str]) -> str:
    """An adapter's path as the server shows it to clients: relative to the
    deepest of `roots` that holds it (as written, or with symlinks resolved),
    else the adapter directory's name alone (a `--lora-modules` path). The
    server's own directory layout is none of a client's business."""
    for resolve in (os.path.abspath, os.path.realpath):
        real = resolve(path)
        holders = [r for r in map(resolve, roots) if os.path.commonpath([real, r]) == r]
        if holders:
            relative = os.path.relpath(real, max(holders, key=len))
            if relative != ".":
                return relative
            break
    return os.path.basename(os.path.normpath(path))
