"""`loraserve train` on the embedded tiny model (examples/train: 3 adapters
of ranks 8, 32, 128) writes PEFT adapters that `vllm serve --plugin
loraserve` serves with HF + PEFT's outputs; publishing a new version to the
running server moves the alias for new requests while a streamed request in
flight finishes on the version it started with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from vllm_loraserve.train.config import PublishConfig
from vllm_loraserve.train.publish import publish

from .reference import HFReference, Request, mismatches
from .server import vllm_server

pytestmark = pytest.mark.e2e
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "train")
NAMES = ("colours", "numbers", "echo")


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    out = root / "out"
    proc = subprocess.run([sys.executable, "-m", "vllm_loraserve.cli.main", "train",
                           "--model", os.path.join(tiny_assets, "model"),
                           "--config", os.path.join(EXAMPLE, "train.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in NAMES:
        assert f"wrote {n}: " in proc.stdout
    assert "samples/s" in proc.stderr  # tqdm progress with per-adapter losses
    return root


@pytest.fixture(scope="module")
def server(tiny_assets, trained, tmp_path_factory):
    args = ["--plugin", "loraserve", "--max-lora-rank", "128", "--max-loras", "2",
            "--loraserve-allowed-root", str(trained),
            "--lora-modules", *(f"{n}={trained}/out/{n}" for n in NAMES)]
    with vllm_server(os.path.join(tiny_assets, "model"), args,
                     str(tmp_path_factory.mktemp("log")),
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


def _complete(url, model, prompt, n):
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"token_ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]}


def test_trained_adapters_are_peft_and_served_like_peft(server, trained, tiny_assets):
    ref = HFReference(os.path.join(tiny_assets, "model"))
    prompt = [5, 17, 42, 99, 7, 64]
    problems = []
    for n in NAMES:
        cfg = json.load(open(trained / "out" / n / "adapter_config.json"))
        assert cfg["peft_type"] == "LORA" and cfg["r"] in (8, 32, 128)
        req = Request(prompt, n, str(trained / "out" / n))
        problems += [f"{n}: {p}" for p in mismatches(ref, req, _complete(server, n, prompt, 6), 6)]
    assert not problems, "\n".join(problems)


def test_publish_moves_alias_and_in_flight_request_keeps_its_version(server, trained,
                                                                     tiny_assets):
    out = trained / "out"
    v1, v2 = str(trained / "pub@1"), str(trained / "pub@2")  # two versions of one adapter
    shutil.copytree(out / "echo@3", v1)
    shutil.copytree(out / "echo@6", v2)
    cfg = PublishConfig(servers=(server,))
    publish({"pub@1": v1}, cfg)
    prompt, n = [5, 17, 42, 99], 150
    tokens, logprobs, after_publish = [], [], 0
    with httpx.stream("POST", f"{server}/v1/completions", timeout=300, json={
            "model": "pub", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
            "stream": True}) as r:
        published = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice.get("token_ids") or []
            logprobs += choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else []
            if published:
                after_publish += 1
            elif tokens:
                publish({"pub@2": v2}, cfg)  # while this request is in flight
                published = True
    assert after_publish > 0  # the request was still streaming after the publish
    ref = HFReference(os.path.join(tiny_assets, "model"))
    old = mismatches(ref, Request(prompt, "v1", v1), {"token_ids": tokens,
                                                      "logprobs": logprobs}, n)
    assert not old, "\n".join(old)
    new = _complete(server, "pub", prompt, 6)
    assert not mismatches(ref, Request(prompt, "v2", v2), new, 6)
    assert mismatches(ref, Request(prompt, "v1b", v1), new, 6)  # the versions differ
    listed = httpx.get(f"{server}/loraserve/v1/adapters", timeout=60).json()["adapters"]
    assert {"pub@1", "pub@2"} <= {a["name"] for a in listed}
    ids = [m["id"] for m in httpx.get(f"{server}/v1/models", timeout=60).json()["data"]]
    assert all(ids.count(name) == 1 for name in ("pub", "pub@1", "pub@2")), ids
