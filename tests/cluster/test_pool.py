"""The distributed adapter pool's parts: engine stores, the TCP transport
between them, and the adapter source registry."""

from __future__ import annotations

import asyncio
import filecmp
import io
import os
import shutil
import tarfile

import pytest

from vllm_loraserve.adapters.safety import PathOutsideRoots
from vllm_loraserve.cluster.sources import LocalDirSource, make_source
from vllm_loraserve.cluster.store import AdapterStore
from vllm_loraserve.cluster.transport import make_transport


def same_tree(a: str, b: str) -> bool:
    cmp = filecmp.dircmp(a, b)
    return not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files)


def test_store_tar_round_trip_and_rejects_foreign_paths(tiny_assets, tmp_path):
    src = AdapterStore(str(tmp_path / "a"))
    src.copy_in("adapter-001-r16", os.path.join(tiny_assets, "adapters", "adapter-001-r16"))
    dst = AdapterStore(str(tmp_path / "b"))
    dst.put_tar("adapter-001-r16", src.tar("adapter-001-r16"))
    assert dst.names() == ["adapter-001-r16"]
    assert same_tree(src.path("adapter-001-r16"), dst.path("adapter-001-r16"))
    assert dst.size_bytes("adapter-001-r16") == src.size_bytes("adapter-001-r16") > 0

    for bad in ("../etc", "a/b", ".", "", "x" * 300):
        with pytest.raises(ValueError, match="invalid adapter name"):
            dst.path(bad)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("other/evil.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="holds other paths"):
        dst.put_tar("victim", buf.getvalue())
    assert dst.names() == ["adapter-001-r16"]
    with pytest.raises(KeyError):
        dst.tar("absent")
    dst.remove("adapter-001-r16")
    assert dst.names() == []


def test_store_put_files_writes_whole_adapters_and_refuses_foreign_paths(tmp_path):
    store = AdapterStore(str(tmp_path / "s"))
    store.put_files("a", [("adapter_config.json", b"{}"), ("sub/w.bin", memoryview(b"xyz"))])
    assert (tmp_path / "s" / "a" / "sub" / "w.bin").read_bytes() == b"xyz"
    store.put_files("a", [("adapter_config.json", b"{1}")])  # replaces the whole adapter
    assert sorted(os.listdir(store.path("a"))) == ["adapter_config.json"]
    for bad in ("../b/x", "/etc/x", "sub/../../x", "."):
        with pytest.raises(ValueError, match="outside"):
            store.put_files("b", [("ok.json", b"{}"), (bad, b"x")])
    with pytest.raises(ValueError, match="no files"):
        store.put_files("b", [])
    assert store.names() == ["a"] and not (tmp_path / "b").exists()


def test_adapters_with_files_outside_their_roots_are_not_copied_or_sent(tiny_assets, tmp_path):
    """A file symlinked out of the roots is read by neither the source's copy
    (shutil.copytree follows links) nor the store's tar for a peer."""
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    (tmp_path / "secret").write_text("x")
    root = tmp_path / "root"
    shutil.copytree(good, root / "leaky")
    os.symlink(tmp_path / "secret", root / "leaky" / "README.md")
    source, store = LocalDirSource(str(root)), AdapterStore(str(tmp_path / "store"))
    _, invalid = source.scan()
    assert "outside the adapter roots" in invalid["leaky"]
    with pytest.raises(PathOutsideRoots, match="its file 'README.md'"):
        source.copy_to("leaky", store)
    assert store.names() == []
    shutil.copytree(good, store.path("leaky"))  # as if put there by hand
    os.symlink(tmp_path / "secret", os.path.join(store.path("leaky"), "README.md"))
    with pytest.raises(PathOutsideRoots, match="its file 'README.md'"):
        store.tar("leaky")


def test_tcp_transport_moves_an_adapter_between_stores(tiny_assets, tmp_path):
    async def body():
        holder = AdapterStore(str(tmp_path / "holder"))
        holder.copy_in("adapter-004-r128",
                       os.path.join(tiny_assets, "adapters", "adapter-004-r128"))
        target = AdapterStore(str(tmp_path / "target"))
        server, client = make_transport("tcp"), make_transport("tcp")
        address = await server.serve(holder)
        assert address.startswith("127.0.0.1:")
        try:
            n = await client.fetch(address, "adapter-004-r128", target)
            assert n > holder.size_bytes("adapter-004-r128")  # tar headers on top
            assert same_tree(holder.path("adapter-004-r128"), target.path("adapter-004-r128"))
            with pytest.raises(RuntimeError, match="could not send 'absent'"):
                await client.fetch(address, "absent", target)
            assert target.names() == ["adapter-004-r128"]
        finally:
            await server.close()
        with pytest.raises(OSError):
            await client.fetch(address, "adapter-004-r128", target)
    asyncio.run(body())


def test_local_source_lists_valid_adapters_and_says_why_others_are_not(tiny_assets, tmp_path):
    good = os.path.join(tiny_assets, "adapters")
    extra = tmp_path / "extra"
    (extra / "no-config").mkdir(parents=True)
    (extra / "no-config" / "adapter_model.safetensors").write_bytes(b"junk")
    source = make_source("local", os.pathsep.join([good, str(extra)]))
    valid, invalid = source.scan()
    assert sorted(e.name for e in valid) == sorted(os.listdir(good))
    assert {e.rank for e in valid} == {8, 16, 32, 64, 128}
    assert list(invalid) == ["no-config"] and "adapter_config.json" in invalid["no-config"]

    store = AdapterStore(str(tmp_path / "store"))
    source.copy_to("adapter-002-r32", store)
    assert same_tree(os.path.join(good, "adapter-002-r32"), store.path("adapter-002-r32"))
    with pytest.raises(KeyError, match="no adapter 'absent'"):
        source.copy_to("absent", store)
    with pytest.raises(ValueError, match="unknown adapter source"):
        make_source("s3", "bucket")
    assert isinstance(source, LocalDirSource)
