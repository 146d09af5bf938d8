"""`vllm serve MODEL --plugin loraserve ...` as typed: adapter listing and
residency, bad input, runtime loading, per-adapter metrics."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time

import httpx
import openai
import pytest
from transformers import AutoConfig

from vllm_loraserve.adapters.peft import inspect_adapter
from vllm_loraserve.frontend import errors
from vllm_loraserve.paging.model import model_layout

from .bad_adapters import (
    EXPECTED_REASONS,
    INF_WEIGHTS,
    build_bad_adapters,
    build_file_link,
    build_huge_alpha,
    build_inf_weights,
)
from .reference import HFReference, Request, mismatches
from .server import metric_samples, vllm_server

pytestmark = pytest.mark.e2e
BASE = "tiny"
# The host tier holds the files' bytes: r8 0.3 MB, r64 2.5 MB and r128 5.0 MB fit
# together (test_residency_follows_use), one more r32 (1.25 MB) does not.
HOST_BYTES = 8 << 20


# Inf weights as INF_WEIGHTS, for the prefetch test (INF_WEIGHTS's own first read
# is a request's, in test_non_finite_adapters_are_400).
INF_PREFETCH = "inf-weights-prefetch"
# Good adapters, broken on disk after start-up by the test that uses them.
VICTIMS = {"victim-truncated": "adapter-002-r32", "victim-deleted": "adapter-003-r64"}


@pytest.fixture(scope="module")
def victims(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("victims")
    for name, source in VICTIMS.items():
        shutil.copytree(os.path.join(tiny_assets, "adapters", source), root / name)
    return root


@pytest.fixture(scope="module")
def runtime_root(tmp_path_factory):
    """The server's --loraserve-allowed-root: runtime loads may read here."""
    return tmp_path_factory.mktemp("runtime-root")


@pytest.fixture(scope="module")
def server(tiny_assets, victims, tmp_path_factory, runtime_root):
    bad = tmp_path_factory.mktemp("bad")
    build_bad_adapters(tiny_assets, str(bad))
    build_inf_weights(tiny_assets, str(bad))
    shutil.copytree(bad / INF_WEIGHTS, bad / INF_PREFETCH)
    build_file_link(tiny_assets, str(bad), str(tmp_path_factory.mktemp("outside")))
    adapters = os.path.join(tiny_assets, "adapters")
    # One vLLM slot; 48 KV pages (47 usable) and an 8 MiB host tier hold a few
    # of the adapters at a time, so residency moves with use.
    args = ["--plugin", "loraserve", "--served-model-name", BASE,
            "--max-lora-rank", "128", "--max-loras", "1", "--num-gpu-blocks-override", "48",
            "--loraserve-host-cache-bytes", str(HOST_BYTES),
            "--loraserve-adapter-dir", adapters, "--loraserve-adapter-dir", str(bad),
            "--loraserve-adapter-dir", str(victims),
            "--loraserve-allowed-root", str(runtime_root),
            "--lora-modules", f"static-ok={adapters}/adapter-001-r16",
            f"static-bad={bad}/rank-256", f"static-inf={bad}/{INF_WEIGHTS}"]
    with vllm_server(os.path.join(tiny_assets, "model"), args,
                     str(tmp_path_factory.mktemp("log")),
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


def _complete(url, model, prompt="Hello there", max_tokens=4):
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _adapters(url):
    r = httpx.get(f"{url}/loraserve/v1/adapters", timeout=60)
    assert r.status_code == 200
    return {a["name"]: a for a in r.json()["adapters"]}


def test_models_lists_servable_adapters_only(server, tiny_assets):
    ids = {m["id"] for m in httpx.get(f"{server}/v1/models", timeout=120).json()["data"]}
    records = json.load(open(os.path.join(tiny_assets, "adapters.json")))
    # INF_WEIGHTS passes the header checks: servable until its first request reads it
    assert ids - {INF_WEIGHTS, INF_PREFETCH} == {BASE, "static-ok", *VICTIMS,
                                                 *(r["name"] for r in records)}


def test_adapter_listing_fields(server, tiny_assets):
    listed = _adapters(server)
    for r in json.load(open(os.path.join(tiny_assets, "adapters.json"))):
        a = listed[r["name"]]
        spec = inspect_adapter(os.path.join(tiny_assets, r["path"]))
        assert a["status"] == "ready" and a["source"] == "adapter-dir"
        assert (a["rank"], a["alpha"]) == (r["rank"], r["alpha"])
        assert a["target_modules"] == sorted(r["target_modules"])
        assert a["size_bytes"] == spec.size_bytes > 0
        assert a["residency"] in ("disk", "host", "device")
        assert a["path"] == r["name"]  # relative to its --loraserve-adapter-dir
    assert listed["static-ok"]["source"] == "lora-modules"
    assert listed["static-ok"]["path"] == "adapter-001-r16"
    assert not [a for a in listed.values() if os.path.isabs(a["path"])]
    assert listed["static-bad"]["status"] == "invalid"
    for name, reason in EXPECTED_REASONS.items():
        assert listed[name]["status"] == "invalid" and reason in listed[name]["error"]
    one = httpx.get(f"{server}/loraserve/v1/adapters/adapter-002-r32", timeout=120).json()
    assert one["rank"] == 32
    assert httpx.get(f"{server}/loraserve/v1/adapters/nope", timeout=120).status_code == 404


def _pages(tiny_assets, name):
    """Pages an adapter holds: its true rank, in the CPU engine's KV pages
    (block size 128 x 2 KV heads x 2 x head size 32 fp32 elements)."""
    spec = inspect_adapter(os.path.join(tiny_assets, "adapters", name))
    layout = model_layout(AutoConfig.from_pretrained(os.path.join(tiny_assets, "model")),
                          2 * 128 * 2 * 32)
    return layout.place(spec.rank, spec.target_modules).num_pages


def test_residency_follows_use(server, tiny_assets):
    """47 usable pages: r8 (3) and r64 (17) fit together; r128 (34) evicts
    both, least recently used first; more adapters push r8 out of the host
    tier. (Whether r8 is still in the host tier right after r128 came in
    depends on where the tier's extents lie in its arena: not asserted.)"""
    x, r64, r128 = "adapter-005-r8", "adapter-003-r64", "adapter-004-r128"
    for name in (x, r64):
        assert _complete(server, name).status_code == 200
    listed = _adapters(server)
    assert (listed[x]["residency"], listed[x]["pages"]) == (
        "device", _pages(tiny_assets, x)) == ("device", 3)
    assert listed[r64]["pages"] == _pages(tiny_assets, r64) == 17
    assert _complete(server, r128).status_code == 200
    listed = _adapters(server)
    assert listed[r128]["pages"] == 34 and listed[r128]["residency"] == "device"
    for evicted in (x, r64):
        assert listed[evicted]["residency"] in ("host", "disk") and "pages" not in listed[evicted]
    for other in ("adapter-002-r32", "adapter-001-r16", "adapter-000-r8", r128):
        assert _complete(server, other).status_code == 200
    listed = _adapters(server)
    assert listed[x]["residency"] == "disk"
    gpu_pages = sum(a.get("pages", 0) for a in listed.values())
    assert gpu_pages <= 47


def test_concurrent_adapters_with_one_vllm_slot_match_hf_peft(server, tiny_assets):
    """`--max-loras 1`, four adapters and the base model at once over HTTP:
    greedy tokens and logprobs equal HF transformers + PEFT (fp32)."""
    names = ["adapter-000-r8", "adapter-001-r16", "adapter-002-r32", "adapter-003-r64", None]
    rng = random.Random(5)
    reqs = [Request([rng.randrange(8, 250) for _ in range(rng.randint(4, 30))], n,
                    os.path.join(tiny_assets, "adapters", n) if n else None)
            for n in names for _ in range(2)]

    async def one(client, req):
        r = await client.post(f"{server}/v1/completions", json={
            "model": req.lora_name or BASE, "prompt": req.prompt_ids, "max_tokens": 6,
            "temperature": 0, "logprobs": 0, "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"token_ids": choice["token_ids"],
                "logprobs": choice["logprobs"]["token_logprobs"]}

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, q) for q in reqs))

    outs = asyncio.run(all_at_once())
    ref = HFReference(os.path.join(tiny_assets, "model"))
    problems = [f"{q.lora_name or 'base'}: {p}" for q, o in zip(reqs, outs, strict=True)
                for p in mismatches(ref, q, o, 6)]
    assert not problems, "\n".join(problems)


# Adapters the server's start-up finds invalid besides EXPECTED_REASONS
# (static-inf: its worker's read refused it, at its --lora-modules load).
OTHER_REASONS = {"static-bad": "rank 256", "static-inf": "holds non-finite values (NaN or Inf)",
                 "file-link": "its file 'adapter_model.safetensors' resolves to"}


@pytest.mark.parametrize("name", [*EXPECTED_REASONS, *OTHER_REASONS])
def test_bad_adapter_gets_400_with_reason_and_others_keep_serving(server, name):
    r = _complete(server, name)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"LoRA adapter '{name}' cannot be served" in message
    assert {**EXPECTED_REASONS, **OTHER_REASONS}[name] in message
    assert _complete(server, "adapter-001-r16").status_code == 200
    assert _complete(server, BASE).status_code == 200


# Why an adapter broken on disk cannot be served: the engine's read failed
# (with the paged pool the API server reads no tensors, so nothing else can
# find it broken).
ENGINE_READ = "its files could not be read"


def _read_failure(response, name, reasons=(ENGINE_READ,)):
    message = response.json()["error"]["message"]
    return f"LoRA adapter '{name}' cannot be served" in message and \
        any(reason in message for reason in reasons)


def test_adapters_broken_on_disk_after_their_checks_fail_alone(server, victims, tiny_assets,
                                                                 runtime_root):
    """Truncated, deleted or made unreadable after start-up (a runtime load,
    after it left the host tier): an adapter's requests fail with a message naming it,
    the requests sent with them are answered exactly, the adapter is listed
    invalid with the reason, and the engine keeps serving. (The directory
    victims are broken before their first request, the runtime loads after
    their read at load: only the engine's read finds either broken.)"""
    either = (ENGINE_READ,)
    weights = victims / "victim-truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    shutil.rmtree(victims / "victim-deleted")

    rng = random.Random(9)
    good = [Request([rng.randrange(8, 250) for _ in range(rng.randint(4, 30))], n,
                    os.path.join(tiny_assets, "adapters", n) if n else None)
            for n in ("adapter-001-r16", "adapter-005-r8", None)]

    async def post(client, model, prompt):
        return await client.post(f"{server}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": True})

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(post(client, q.lora_name or BASE, q.prompt_ids) for q in good),
                *(post(client, name, "Hello there") for name in [*VICTIMS, *VICTIMS]))

    responses = asyncio.run(all_at_once())
    for r, name in zip(responses[len(good):], [*VICTIMS, *VICTIMS], strict=True):
        assert r.status_code in (400, 500) and _read_failure(r, name, either), \
            (r.status_code, r.text)
    outs = []
    for r in responses[:len(good)]:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        outs.append({"token_ids": choice["token_ids"],
                     "logprobs": choice["logprobs"]["token_logprobs"]})
    ref = HFReference(os.path.join(tiny_assets, "model"))
    problems = [p for q, o in zip(good, outs, strict=True) for p in mismatches(ref, q, o, 6)]
    assert not problems, "\n".join(problems)

    listed = _adapters(server)
    for name in VICTIMS:
        assert listed[name]["status"] == "invalid"
        assert any(reason in listed[name]["error"] for reason in either)
        r = _complete(server, name)
        assert r.status_code == 400 and _read_failure(r, name, either)

    # Runtime loads are read into the host tier at once; broken once they left it.
    def unreadable(path):  # the weights file is now a directory
        weights = path / "adapter_model.safetensors"
        weights.unlink()
        weights.mkdir()

    breakers = {"late-deleted": shutil.rmtree, "late-unreadable": unreadable}
    for name in breakers:
        late = runtime_root / name  # runtime loads read only under the adapter roots
        shutil.copytree(os.path.join(tiny_assets, "adapters", "adapter-005-r8"), late)
        r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": name, "lora_path": str(late)})
        assert r.status_code == 200, r.text
    for other in ("adapter-004-r128", "adapter-003-r64", "adapter-002-r32", "adapter-000-r8",
                  "adapter-001-r16"):
        assert _complete(server, other).status_code == 200
    listed = _adapters(server)
    for name, brk in breakers.items():
        assert listed[name]["residency"] == "disk"
        brk(runtime_root / name)
    r = _complete(server, "late-deleted")
    assert r.status_code in (400, 500) and _read_failure(r, "late-deleted"), r.text
    # Streamed: the error event names the adapter too (a finish reason
    # "error" before the first token alone would end the stream empty).
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "late-unreadable", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert r.status_code == 200 and events and "error" in events[-1], r.text
    message = events[-1]["error"]["message"]
    assert "LoRA adapter 'late-unreadable' cannot be served" in message
    assert ENGINE_READ in message, message
    assert "late-unreadable" not in _model_ids(server)  # registered, but not servable
    assert _complete(server, "adapter-001-r16").status_code == 200
    assert _complete(server, BASE).status_code == 200
    # Unloading the broken adapter clears its failure; its name can be reused.
    r = httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120,
                   json={"lora_name": "late-deleted"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "late-deleted",
        "lora_path": os.path.join(tiny_assets, "adapters", "adapter-005-r8")})
    assert r.status_code == 200, r.text
    assert _complete(server, "late-deleted").status_code == 200


def test_unknown_adapter_is_404(server):
    r = _complete(server, "no-such-adapter")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def _prefetch(url, name):
    return httpx.post(f"{url}/loraserve/v1/adapters/{name}/prefetch", timeout=60)


def _until(answer, done, limit=60.0):
    """`answer()` again until `done(its result)`, at most `limit` seconds."""
    deadline = time.monotonic() + limit
    while not done(result := answer()):
        assert time.monotonic() < deadline, f"still {result}"
        time.sleep(0.2)
    return result


def test_prefetch_reads_an_adapter_into_the_host_tier_and_reports_a_bad_one(server):
    """The prefetch route reads an adapter from disk into the workers' host
    tier with no request (202 while it reads, 200 once there); an adapter
    whose read fails gets 400 with why, and so do its requests; unknown and
    invalid names are refused as a request naming them would be."""
    on_disk = sorted(n for n, a in _adapters(server).items()
                     if a["status"] == "ready" and a["residency"] == "disk"
                     and n.startswith("adapter-"))
    assert on_disk, "every adapter is already off disk: nothing to prefetch"
    name = on_disk[0]
    r = _prefetch(server, name)
    assert r.status_code in (200, 202) and r.json()["state"] in ("host", "reading"), r.text
    _until(lambda: _adapters(server)[name]["residency"], lambda tier: tier == "host")
    r = _prefetch(server, name)
    assert (r.status_code, r.json()["state"]) == (200, "host"), r.text
    assert _complete(server, name).status_code == 200

    # Its header passes the checks; its one Inf weight is found by the read.
    r = _until(lambda: _prefetch(server, INF_PREFETCH), lambda r: r.status_code != 202)
    assert r.status_code == 400, r.text
    assert "holds non-finite values (NaN or Inf)" in r.json()["error"]["message"]
    assert _adapters(server)[INF_PREFETCH]["status"] == "invalid"
    r = _complete(server, INF_PREFETCH)
    assert r.status_code == 400 and "holds non-finite values" in r.json()["error"]["message"]

    r = _prefetch(server, "no-such-adapter")
    assert r.status_code == 404 and "unknown LoRA adapter" in r.json()["error"]["message"]
    r = _prefetch(server, "rank-256")
    assert r.status_code == 400 and "rank 256" in r.json()["error"]["message"]
    assert _complete(server, "adapter-001-r16").status_code == 200


def test_runtime_load_checks_and_unload_frees(server, tiny_assets, runtime_root):
    bad = runtime_root / "bad"
    build_bad_adapters(tiny_assets, str(bad))
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "late-bad", "lora_path": str(bad / "wrong-base")})
    assert r.status_code == 400 and "does not fit this base model" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == errors.ADAPTER_INVALID
    # a refused runtime load leaves nothing behind: the name stays unknown
    assert "late-bad" not in _adapters(server)
    assert _complete(server, "late-bad").status_code == 404

    good = os.path.join(tiny_assets, "adapters", "adapter-003-r64")
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "late", "lora_path": good})
    assert r.status_code == 200, r.text
    assert _complete(server, "late").status_code == 200
    assert _adapters(server)["late"]["source"] == "runtime"

    r = httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120, json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    assert "late" not in _adapters(server)
    assert _complete(server, "late").status_code == 404


def test_failed_runtime_loads_do_not_accumulate(server, tiny_assets, runtime_root):
    bad = runtime_root / "bad2"
    build_bad_adapters(tiny_assets, str(bad))
    before = _adapters(server)
    for i, name in enumerate(sorted(EXPECTED_REASONS) * 3):
        r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": f"fail-{i}", "lora_path": str(bad / name)})
        assert r.status_code == 400 and EXPECTED_REASONS[name] in r.text, r.text
    assert _adapters(server).keys() == before.keys()
    assert _complete(server, "adapter-001-r16").status_code == 200


def test_refused_duplicate_load_keeps_the_served_entry(server, tiny_assets):
    adapters = os.path.join(tiny_assets, "adapters")
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "dup", "lora_path": f"{adapters}/adapter-003-r64"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "dup", "lora_path": f"{adapters}/adapter-000-r8"})
    assert r.status_code == 400 and r.json()["error"]["type"] == errors.ADAPTER_LOADED, r.text
    entry = _adapters(server)["dup"]
    assert (entry["rank"], entry["path"]) == (64, "adapter-003-r64")
    assert _complete(server, "dup").status_code == 200
    httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120, json={"lora_name": "dup"})


def test_load_outside_the_roots_is_403(server, tiny_assets, runtime_root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(tiny_assets, "adapters", "adapter-000-r8"), outside)
    os.symlink(outside, runtime_root / "link-out")
    # an adapter inside the roots whose weights file is a symlink out of them
    file_link = build_file_link(tiny_assets, str(runtime_root), str(tmp_path))
    for path in (str(outside), f"{runtime_root}/../{tmp_path.name}/outside",
                 str(runtime_root / "link-out"), "/etc", file_link):
        r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": "escape", "lora_path": path})
        assert r.status_code == 403, (path, r.text)
        assert "outside the adapter roots" in r.json()["error"]["message"]
    assert "escape" not in _adapters(server)
    shutil.copytree(outside, runtime_root / "inside")
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "inside", "lora_path": str(runtime_root / "inside")})
    assert r.status_code == 200, r.text
    assert _complete(server, "inside").status_code == 200
    httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120, json={"lora_name": "inside"})


@pytest.mark.parametrize("name, reason", [
    ("a/b", "invalid adapter name"), ("..", "invalid adapter name"),
    ("../x", "invalid adapter name"), ("bad\nname", "invalid adapter name"),
    ("x" * 10_000, "10000 characters"), (BASE, "name of a served base model"),
    (f"{BASE}@1", f"its alias '{BASE}' is the name of a served base model"),
    ("name\n", "invalid adapter name"),
])
def test_unsafe_adapter_names_are_400(server, tiny_assets, name, reason):
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": name, "lora_path": good})
    assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert name not in _adapters(server)
    # base-model requests still go to the base model, listed once
    assert _complete(server, BASE).json()["model"] == BASE
    assert _model_ids(server).count(BASE) == 1


def _model_ids(url):
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]]


def _load(url, name, path, inplace=False):
    return httpx.post(f"{url}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": name, "lora_path": path, "load_inplace": inplace})


def test_an_alias_never_shadows_another_adapter(server, tiny_assets, runtime_root):
    """The alias rule (adapters/safety.py): a plain name that is the alias of
    served versions is refused, also as an in-place reload; a version of a
    served plain adapter leaves it its name until it is unloaded."""
    adapters = os.path.join(tiny_assets, "adapters")
    for name, source in (("line", "adapter-000-r8"), ("line-1", "adapter-003-r64")):
        if not (runtime_root / name).exists():
            shutil.copytree(os.path.join(adapters, source), runtime_root / name)
    plain, version = str(runtime_root / "line"), str(runtime_root / "line-1")
    assert _load(server, "ver@1", version).status_code == 200
    for inplace in (False, True):
        r = _load(server, "ver", plain, inplace)
        assert r.status_code == 400, r.text
        assert "alias of the served version 'ver@1'" in r.json()["error"]["message"]
    # shown relative to its root (the server's layout is none of a client's business)
    assert version.endswith("/line-1")
    assert _adapters(server)["ver@1"]["path"] == "line-1" and "ver" not in _adapters(server)
    assert httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120,
                      json={"lora_name": "ver@1"}).status_code == 200
    assert "ver" not in _model_ids(server)

    assert _load(server, "line", plain).status_code == 200
    assert _load(server, "line@1", version).status_code == 200
    cards = {m["id"]: m for m in httpx.get(f"{server}/v1/models", timeout=120).json()["data"]}
    assert cards["line"]["root"] == plain and cards["line@1"]["root"] == version
    assert httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120,
                      json={"lora_name": "line"}).status_code == 200
    cards = {m["id"]: m for m in httpx.get(f"{server}/v1/models", timeout=120).json()["data"]}
    assert cards["line"]["root"] == version  # the alias follows the version line now
    assert _complete(server, "line").status_code == 200
    assert httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120,
                      json={"lora_name": "line@1"}).status_code == 200
    assert not {"line", "line@1"} & set(_model_ids(server))


def _check_agreement(url):
    """`/v1/models`, the listing and the worker's copies tell one story:
    each model id is a ready adapter or an alias of one of its versions,
    listed once; no copy on the worker without a listed owner; the pages of
    the listed adapters are the pool's adapter pages."""
    assert _complete(url, BASE).status_code == 200  # a step: pending evictions reach the worker
    r = httpx.get(f"{url}/loraserve/v1/adapters", timeout=60).json()
    ready = {a["name"] for a in r["adapters"] if a["status"] == "ready"}
    ids = _model_ids(url)
    assert len(ids) == len(set(ids)), ids
    aliases = set(ids) - ready - {BASE}
    assert all(any(n.startswith(f"{a}@") for n in ready) for a in aliases), (aliases, ready)
    assert ready <= set(ids), ready - set(ids)
    assert r["orphans"] == [], r["orphans"]
    pages = sum(a.get("pages", 0) for a in r["adapters"])
    assert metric_samples(url)[("loraserve_pool_pages", (("kind", "adapter"),))] == pages
    return ready, set(ids)


def test_same_name_load_unload_storm(server, tiny_assets, runtime_root):
    """Issue 22: loads, in-place reloads and unloads of the same names at the
    same moment, with requests for them (and for an alias): no 5xx, and
    afterwards every view of the adapters agrees."""
    adapters = os.path.join(tiny_assets, "adapters")
    paths = {}
    for name, source in (("storm-a", "adapter-000-r8"), ("storm-b", "adapter-002-r32"),
                         ("wave@1", "adapter-001-r16"), ("wave@2", "adapter-005-r8")):
        dest = runtime_root / name.replace("@", "-v")
        if not dest.exists():
            shutil.copytree(os.path.join(adapters, source), dest)
        paths[name] = str(dest)
    rng = random.Random(22)
    statuses: dict[tuple[str, int], int] = {}
    errors_5xx = []

    async def call(client, kind, name):
        if kind == "unload":
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        elif kind in ("load", "reload"):
            r = await client.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": paths[name], "load_inplace": kind == "reload"})
        else:
            r = await client.post("/v1/completions", json={
                "model": name, "prompt": "storm", "max_tokens": 2, "temperature": 0})
        statuses[(kind, r.status_code)] = statuses.get((kind, r.status_code), 0) + 1
        if r.status_code >= 500:
            errors_5xx.append(f"{kind} {name}: {r.status_code} {r.text[:300]}")

    async def storm():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            for _ in range(10):
                ops = [(k, n) for n in paths for k in ("load", "unload", "reload", "request")]
                ops.append(("request", "wave"))
                rng.shuffle(ops)
                await asyncio.gather(*(call(client, k, n) for k, n in ops))

    asyncio.run(storm())
    assert not errors_5xx, errors_5xx
    assert statuses.get(("unload", 200), 0) >= 5 and statuses.get(("load", 200), 0) >= 5, \
        statuses
    assert statuses.get(("request", 200), 0) >= 5, statuses
    ready, ids = _check_agreement(server)
    for name in paths:  # the storm's names go; nothing of them stays anywhere
        httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120, json={"lora_name": name})
    ready, ids = _check_agreement(server)
    assert not (set(paths) | {"wave"}) & (ready | ids)


def test_non_finite_adapters_are_400(server, tiny_assets, runtime_root):
    """NaN alpha (header) and Inf weights (tensors): 400 at load or on first
    request, naming the adapter and the problem; the adapter listing keeps
    answering, other adapters keep being served. The tensors are checked by
    the worker's read into the host tier (its add_lora at a runtime load, its
    reader on the directory adapter's first request)."""
    nan_alpha = runtime_root / "nan"
    build_bad_adapters(tiny_assets, str(nan_alpha))
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "nan-rt", "lora_path": str(nan_alpha / "nan-alpha")})
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"]
    inf = build_inf_weights(tiny_assets, str(runtime_root))
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={"lora_name": "inf-rt",
                                                          "lora_path": inf})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(
        "LoRA adapter 'inf-rt' cannot be served: tensor lora_"), r.text
    assert "holds non-finite values (NaN or Inf)" in r.json()["error"]["message"]
    assert "inf-rt" not in _adapters(server)  # a refused runtime load leaves nothing
    # finite, but B * scaling overflows the serving dtype
    huge = build_huge_alpha(tiny_assets, str(runtime_root))
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120, json={"lora_name": "huge-rt",
                                                          "lora_path": huge})
    assert r.status_code == 400, r.text
    assert "the largest value of the serving dtype" in r.json()["error"]["message"]
    # the directory adapter: its first request's read in the worker refuses it
    r = _complete(server, INF_WEIGHTS)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"LoRA adapter '{INF_WEIGHTS}' cannot be served: tensor lora_" in message
    assert "holds non-finite values (NaN or Inf)" in message and ENGINE_READ not in message
    r = _complete(server, INF_WEIGHTS)  # now refused by the API server at once
    assert r.status_code == 400 and message.startswith(r.json()["error"]["message"])
    listed = _adapters(server)
    assert listed[INF_WEIGHTS]["status"] == "invalid"
    assert listed["nan-alpha"]["status"] == "invalid"
    models = httpx.get(f"{server}/v1/models", timeout=120).json()["data"]
    assert INF_WEIGHTS not in {m["id"] for m in models}
    assert _complete(server, "adapter-000-r8").status_code == 200


def test_load_metrics_keep_the_name_after_unload(server, tiny_assets):
    """Events drained after the unload still carry the adapter's name, and a
    reload adds no new series."""
    good = os.path.join(tiny_assets, "adapters", "adapter-002-r32")

    def cycle():
        r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": "churn", "lora_path": good})
        assert r.status_code == 200, r.text
        assert _complete(server, "churn").status_code == 200
        r = httpx.post(f"{server}/v1/unload_lora_adapter", timeout=120, json={"lora_name": "churn"})
        assert r.status_code == 200, r.text
        return {labels: v for (name, labels), v in metric_samples(server).items()
                if name == "loraserve_adapter_loads_total"}

    first = cycle()
    assert not [labels for labels in first if dict(labels)["adapter"].startswith("lora-id-")]
    churn = {labels for labels in first if dict(labels)["adapter"] == "churn"}
    assert churn, first
    second = cycle()
    assert second.keys() == first.keys()
    assert sum(second[k] for k in churn) > sum(first[k] for k in churn)


def _delta(after, before, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_per_adapter_metrics(server):
    before = metric_samples(server)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x")
    a, b = "adapter-001-r16", "adapter-004-r128"
    usage = {a: [0, 0], b: [0, 0], BASE: [0, 0]}
    for model, prompt in ((a, "one two"), (a, "three four five"), (BASE, "six")):
        u = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      temperature=0).usage
        usage[model][0] += u.prompt_tokens
        usage[model][1] += u.completion_tokens
    stream = client.chat.completions.create(
        model=b, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage:
            usage[b] = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
    after = metric_samples(server)

    assert _delta(after, before, "loraserve_adapter_requests_total",
                  adapter=a, finished_reason="length") == 2
    for model, (prompt, gen) in usage.items():
        assert _delta(after, before, "loraserve_adapter_prompt_tokens_total",
                      adapter=model) == prompt
        assert _delta(after, before, "loraserve_adapter_generation_tokens_total",
                      adapter=model) == gen
    assert all("," not in dict(labels).get("adapter", "") for _, labels in after)
    # The bad ones and static-bad (+ inf-weights once read, + any adapter broken
    # on disk by an earlier test).
    invalid = [a for a in _adapters(server).values() if a["status"] == "invalid"]
    assert len(invalid) >= len(EXPECTED_REASONS) + 1
    assert after[("loraserve_adapters", (("state", "invalid"),))] == len(invalid)
    loads = {dict(labels)["adapter"] for name, labels in after
             if name == "loraserve_adapter_loads_total"}
    assert {a, b} <= loads
    assert after[("loraserve_adapter_load_seconds_count", (("tier", "host"),))] >= 2
    pages = {k: after[("loraserve_pool_pages", (("kind", k),))] for k in ("adapter", "total")}
    assert pages["total"] == 48 and 0 < pages["adapter"] <= 47
    # An eviction of its own: r64 (17 pages) after r128 (34) and r16 needs more
    # than the 47 pages leave free, whatever earlier tests left resident.
    assert _complete(server, "adapter-003-r64").status_code == 200
    evicted = metric_samples(server)
    assert _delta(evicted, after, "loraserve_pool_page_events_total", event="eviction") > 0
    assert 0 < after[("loraserve_pool_host_bytes", ())] <= HOST_BYTES
    prefetch = {r: after[("loraserve_pool_prefetch_total", (("result", r),))]
                for r in ("hit", "miss")}
    assert prefetch["hit"] + prefetch["miss"] == \
        after[("loraserve_pool_page_events_total", (("event", "load"),))] and prefetch["hit"] > 0
    assert _delta(after, before, "loraserve_adapter_wait_seconds_count") >= 3
