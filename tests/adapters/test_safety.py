"""Adapter names and paths from the network (adapters/safety.py)."""

from __future__ import annotations

import os

import pytest

from vllm_loraserve.adapters.safety import (
    PathOutsideRoots,
    check_name,
    check_not_alias,
    newest_version,
    resolve_adapter_under_roots,
    resolve_under_roots,
    shown_path,
)


@pytest.mark.parametrize("name", ["a", "adapter-004-r128", "A.b_c-1", "x" * 200,
                                  "a@12", "a.b@v1-rc"])
def test_safe_names(name):
    assert check_name(name, reserved={"tiny"}) == name


@pytest.mark.parametrize("name, message", [
    ("a/b", "invalid adapter name"),
    ("..", "invalid adapter name"),
    ("../etc", "invalid adapter name"),
    ("a\\b", "invalid adapter name"),
    ("bad\nname", "invalid adapter name"),
    ("name\n", "invalid adapter name"),  # `$` matches before a final newline
    ("a@1\n", "invalid adapter name"),
    ("tab\tname", "invalid adapter name"),
    ("@a", "invalid adapter name"),
    ("a@", "invalid adapter name"),
    ("a@1@2", "invalid adapter name"),
    ("a@../x", "invalid adapter name"),
    ("x" * 201, "201 characters: at most 200"),
    ("x" * 10_000, "10000 characters"),
    ("", "non-empty string"),
    (None, "non-empty string"),
    ("tiny", "name of a served base model"),
    ("tiny@1", "its alias 'tiny' is the name of a served base model"),
])
def test_unsafe_names(name, message):
    with pytest.raises(ValueError, match=message):
        check_name(name, reserved={"tiny"})


def test_a_plain_name_may_not_be_the_alias_of_a_served_version():
    check_not_alias("x", None)  # no alias
    check_not_alias("x", "x")  # the plain adapter itself (a reload)
    with pytest.raises(ValueError, match="'x': it is the alias of the served version 'x@2'"):
        check_not_alias("x", "x@2")


def test_an_alias_names_the_newest_version_of_its_line_only():
    """The server and the router both repoint aliases with this rule."""
    served = ["x@2", "x", "xy@3", "y@1", "x@1"]  # oldest first
    assert newest_version("x", served) == "x@1"  # the last served, not the highest
    assert newest_version("y", served) == "y@1"
    assert newest_version("xy", ["x@1", "xy"]) is None  # the plain adapter is no version


def test_paths_under_roots(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    (root / "a").mkdir(parents=True)
    (other / "b").mkdir(parents=True)
    os.symlink(other / "b", root / "link")
    os.symlink(root / "a", other / "inward")
    assert resolve_under_roots(str(root / "a"), [str(root)]) == str(root / "a")
    # a symlink from outside into a root resolves inside it: allowed
    assert resolve_under_roots(str(other / "inward"), [str(root)]) == str(root / "a")
    for path in (other / "b", root / ".." / "other" / "b", root / "link", tmp_path / "rootx"):
        with pytest.raises(PathOutsideRoots, match="outside the adapter roots"):
            resolve_under_roots(str(path), [str(root)])
    with pytest.raises(PathOutsideRoots, match="no adapter root is configured"):
        resolve_under_roots(str(root / "a"), [])


def test_adapter_files_under_roots(tmp_path):
    """Every file and directory in an adapter, not only the directory itself,
    must resolve inside the roots: a symlinked file is refused by name."""
    root, other = tmp_path / "root", tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "secret").write_text("x")
    (other / "sub" / "secret").write_text("x")
    (root / "shared").mkdir(parents=True)
    (root / "shared" / "adapter_model.safetensors").write_bytes(b"w")

    def adapter(name, links):
        path = root / name
        (path / "nested").mkdir(parents=True)
        for rel, target in links.items():
            os.symlink(target, path / rel)
        if "adapter_config.json" not in links:
            (path / "adapter_config.json").write_text("{}")
        return str(path)

    # links that stay inside the roots (also through a symlinked directory,
    # and a loop) are fine
    ok = adapter("ok", {"adapter_model.safetensors": root / "shared" / "adapter_model.safetensors",
                        "nested/up": root / "ok", "shared": root / "shared"})
    assert resolve_adapter_under_roots(ok, [str(root)]) == ok
    for name, rel, target in [
        ("config", "adapter_config.json", other / "secret"),
        ("weights", "adapter_model.safetensors", other / "secret"),
        ("bin", "adapter_model.bin", other / "secret"),
        ("deep", "nested/readme", other / "secret"),
        ("dangling", "adapter_model.bin", other / "nothing"),
        ("dir-out", "sub", other / "sub"),
    ]:
        path = adapter(name, {rel: target})
        with pytest.raises(PathOutsideRoots, match=f"adapter path '{path}' refused: its file "
                           f"'{rel}' resolves to .*/other/.*, outside the adapter roots"):
            resolve_adapter_under_roots(path, [str(root)])
    # a symlinked directory inside the roots is walked too
    os.symlink(other / "secret", root / "shared" / "leak")
    with pytest.raises(PathOutsideRoots, match="its file 'shared/leak' resolves to"):
        resolve_adapter_under_roots(ok, [str(root)])
    # the directory's own check comes first, as resolve_under_roots does it
    with pytest.raises(PathOutsideRoots, match="no adapter root is configured"):
        resolve_adapter_under_roots(ok, [])


def test_shown_paths_hide_the_server_layout(tmp_path):
    """The listing shows a path relative to its (deepest) root; one under no
    root shows its directory name only."""
    root, nested, other = tmp_path / "root", tmp_path / "root" / "team", tmp_path / "other"
    for d in (root / "a", nested / "b", other / "c"):
        d.mkdir(parents=True)
    os.symlink(root, tmp_path / "root-link")
    roots = [str(root), str(nested)]
    assert shown_path(str(root / "a"), roots) == "a"
    assert shown_path(str(nested / "b"), roots) == "b"
    assert shown_path(str(root / "a"), [str(tmp_path)]) == os.path.join("root", "a")
    # written through a symlink to the root, or with `..`: still relative to it
    assert shown_path(str(tmp_path / "root-link" / "a"), roots) == "a"
    assert shown_path(str(other / ".." / "root" / "a"), roots) == "a"
    assert shown_path(str(other / "c"), roots) == "c"
    assert shown_path(str(root) + "/", roots) == "root"  # the root itself
    assert shown_path(str(other / "c"), []) == "c"
