"""One malformed adapter per failure mode, built from a good one."""

from __future__ import annotations

import json
import os
import shutil

from vllm_loraserve.demo.assets import make_adapter, module_dims

# name -> part of the reason the server must give
EXPECTED_REASONS = {
    "no-config": "adapter_config.json is missing",
    "broken-weights": "unreadable",
    "rank-256": "rank 256 is above this server's maximum LoRA rank 128",
    "wrong-base": "does not fit this base model",
    "bad-target": "unsupported target module(s) ['rotary_proj']",
    "dora": "DoRA",
    "nan-alpha": "'lora_alpha' must be a finite number, got nan",
    # The tiny model has 4 layers; this one's shapes fit (issue 22: it killed the engine).
    "layer-7": "targets model.layers.7.self_attn.q_proj (and 1 more), which this model does "
               "not have",
    # Python's JSON parser raises RecursionError (not a ValueError) on this.
    "deep-config": "is not valid JSON: RecursionError",
}
# Only a read of the tensors finds this one (on its first request).
INF_WEIGHTS = "inf-weights"


def build_bad_adapters(tiny_assets: str, out: str) -> None:
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    model = os.path.join(tiny_assets, "model")
    shutil.copytree(good, os.path.join(out, "no-config"))
    os.remove(os.path.join(out, "no-config", "adapter_config.json"))
    shutil.copytree(good, os.path.join(out, "broken-weights"))
    with open(os.path.join(out, "broken-weights", "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file" * 4)
    dims = module_dims(model, ("q_proj", "v_proj"))
    make_adapter(os.path.join(out, "rank-256"), dims, rank=256, alpha=256, seed=1,
                 base_model="tiny")
    make_adapter(os.path.join(out, "wrong-base"), {k: (2 * i, 2 * o) for k, (i, o) in dims.items()},
                 rank=8, alpha=16, seed=2, base_model="some/bigger-model")
    make_adapter(os.path.join(out, "bad-target"),
                 {**dims, "model.layers.0.self_attn.rotary_proj": (128, 128)},
                 rank=8, alpha=16, seed=3, base_model="tiny")
    make_adapter(os.path.join(out, "layer-7"), layer_7_dims(model), rank=8, alpha=16, seed=4,
                 base_model="tiny")
    shutil.copytree(good, os.path.join(out, "dora"))
    cfg_path = os.path.join(out, "dora", "adapter_config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "use_dora": True}, open(cfg_path, "w"))
    shutil.copytree(good, os.path.join(out, "nan-alpha"))
    cfg_path = os.path.join(out, "nan-alpha", "adapter_config.json")
    json.dump({**cfg, "lora_alpha": float("nan")}, open(cfg_path, "w"))
    shutil.copytree(good, os.path.join(out, "deep-config"))
    with open(os.path.join(out, "deep-config", "adapter_config.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)


def layer_7_dims(model: str) -> dict[str, tuple[int, int]]:
    """q/v of layer 0, renamed to a layer 7 that the 4-layer tiny model lacks."""
    return {k.replace(".layers.0.", ".layers.7."): v
            for k, v in module_dims(model, ("q_proj", "v_proj")).items() if ".layers.0." in k}


def build_inf_weights(tiny_assets: str, out: str) -> str:
    """A copy of a good adapter with one Inf weight: its header is fine."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, INF_WEIGHTS)
    shutil.copytree(os.path.join(tiny_assets, "adapters", "adapter-000-r8"), path)
    st = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(st)
    next(iter(tensors.values()))[0, 0] = float("inf")
    save_file(tensors, st, metadata={"format": "pt"})
    return path


def build_huge_alpha(tiny_assets: str, out: str) -> str:
    """A copy of a good adapter with a finite lora_alpha whose scaling no
    serving dtype holds: only a read of the tensors refuses it."""
    path = os.path.join(out, "huge-alpha")
    shutil.copytree(os.path.join(tiny_assets, "adapters", "adapter-000-r8"), path)
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "lora_alpha": 1e300}, open(cfg_path, "w"))
    return path


def build_file_link(tiny_assets: str, out: str, outside: str) -> str:
    """`out`/file-link: a good adapter whose weights file is a symlink to a
    copy under `outside` (a directory outside the server's adapter roots)."""
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    target = os.path.join(outside, "file-link-target")
    shutil.copytree(good, target)
    path = os.path.join(out, "file-link")
    shutil.copytree(good, path)
    weights = os.path.join(path, "adapter_model.safetensors")
    os.remove(weights)
    os.symlink(os.path.join(target, "adapter_model.safetensors"), weights)
    return path
