"""What a client may call an adapter and where it may point the server.

Adapter names come from the network (`/v1/load_lora_adapter`, the router's
`POST /admin/adapters`) and end up in paths, logs and metric labels; adapter
paths from the network are read by the server. Both are checked here, by the
plugin server and the router alike:
- a name is a plain identifier: letters, digits, `.`, `_`, `-`, starting
  with a letter or digit, optionally followed by one `@version` of the same
  characters (`name@step`, a published training version), at most 200
  characters (so no path separator, `..` or control character, a final
  newline included: the pattern must match the whole name), and neither it
  nor its alias is a served base model's name (`base@1` would take over the
  requests for `base`);
- the alias rule, the same on the server and the router: `name@version` is
  a version of the line `name`, and a request for `name` gets the plain
  adapter `name` while one is served, else the newest served version (its
  alias). An alias never shadows an adapter of another line: a plain name
  that is now the alias of served versions is refused (`check_not_alias`;
  it would silently change what `name` serves), while a version of a served
  plain adapter is accepted and answers to its full name only until the
  plain one is unloaded;
- a path must resolve (symlinks and `..` followed) inside one of the
  configured adapter roots, and so must every file and directory in it
  (`resolve_adapter_under_roots`): a symlinked file would otherwise be read,
  or copied to other engines, from anywhere; the server shows paths relative
  to their root.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable

MAX_NAME_LENGTH = 200
# Used with fullmatch: `$` alone would also accept a name ending in "\n".
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._-]*)?")


class PathOutsideRoots(ValueError):
    """A path that resolves outside every adapter root (HTTP 403)."""


def check_name(name: object, reserved: Collection[str] = ()) -> str:
    """`name` if it is a safe adapter name, else ValueError saying why."""
    if not isinstance(name, str) or not name:
        raise ValueError("invalid adapter name: give a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"invalid adapter name of {len(name)} characters: at most "
                         f"{MAX_NAME_LENGTH} are allowed")
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid adapter name {name!r}: use letters, digits, '.', '_' and "
                         "'-', starting with a letter or digit, and at most one '@version'")
    if name in reserved:
        raise ValueError(f"invalid adapter name {name!r}: it is the name of a served base "
                         "model")
    if alias_of(name) in reserved:
        raise ValueError(f"invalid adapter name {name!r}: its alias {alias_of(name)!r} is the "
                         "name of a served base model")
    return name


def check_not_alias(name: str, version: str | None) -> None:
    """ValueError if `name` is now the alias of the served version `version`
    (None: it is no alias), see the alias rule above."""
    if version is not None and version != name:
        raise ValueError(f"invalid adapter name {name!r}: it is the alias of the served "
                         f"version {version!r}; choose another name")


def alias_of(name: str) -> str:
    """The name a published version `name@version` is served under as an
    alias (`name`); a plain name is its own."""
    return name.partition("@")[0]


def version_order(name: str) -> tuple:
    """A sort key that puts a line's versions oldest first: `name@version` by
    name, then version with its digit runs as numbers (`x@500` before
    `x@1000`); the plain `name` before its versions."""
    alias, _, version = name.partition("@")
    return alias, [(0, int(t), "") if t.isdigit() else (1, 0, t)
                   for t in re.findall(r"\d+|\D+", version)]


def newest_version(alias: str, served: Iterable[str]) -> str | None:
    """The version the alias `alias` names (the alias rule above): the last
    of its line's versions in `served`, oldest first; None if none is served."""
    versions = [n for n in served if n != alias and alias_of(n) == alias]
    return versions[-1] if versions else None


def _inside(real: str, roots: Collection[str]) -> bool:
    return any(os.path.commonpath([real, root]) == root for root in map(os.path.realpath, roots))


def resolve_under_roots(path: str, roots: Collection[str]) -> str:
    """The real path of `path` if it lies inside one of `roots` (each
    resolved too), else PathOutsideRoots naming the roots."""
    if not roots:
        raise PathOutsideRoots(
            f"adapter path {path!r} refused: no adapter root is configured for loads over "
            "HTTP (--loraserve-adapter-dir or --loraserve-allowed-root)")
    real = os.path.realpath(path)
    if not _inside(real, roots):
        raise PathOutsideRoots(f"adapter path {path!r} (resolved: {real}) is outside the "
                               f"adapter roots {sorted(roots)}")
    return real


def resolve_adapter_under_roots(path: str, roots: Collection[str]) -> str:
    """The real path of the adapter directory `path` if it and everything in
    it (walked through symlinked directories, each once) resolve inside one of
    `roots`, else PathOutsideRoots naming the first entry that does not, by
    its path inside the adapter (vLLM's HTTP errors hide absolute paths). The
    one check for every place that reads or copies an adapter's files with
    the roots known (frontend/serving.py, adapters/directory.py,
    cluster/http/admin.py, cluster/sources.py, cluster/store.py)."""
    real = resolve_under_roots(path, roots)
    todo, seen = [(real, "")], {real}
    while todo:
        top, prefix = todo.pop()
        try:
            with os.scandir(top) as it:
                entries = list(it)
        except OSError as e:  # what cannot be listed cannot be checked
            raise PathOutsideRoots(f"adapter path {path!r} refused: its directory "
                                   f"{prefix or '.'!r} cannot be listed to check its files: "
                                   f"{e.strerror}") from None
        for entry in entries:
            rel, target = os.path.join(prefix, entry.name), os.path.realpath(entry.path)
            if not _inside(target, roots):
                raise PathOutsideRoots(f"adapter path {path!r} refused: its file {rel!r} "
                                       f"resolves to {target}, outside the adapter roots "
                                       f"{sorted(roots)}")
            if entry.is_dir() and target not in seen:
                seen.add(target)
                todo.append((target, rel))
    return real


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
