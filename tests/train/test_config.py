"""train.json parsing: defaults, relative paths, and clear errors."""

from __future__ import annotations

import json

import pytest

from vllm_loraserve.train.config import ConfigError, load_config, parse_config

ADAPTER = {"name": "a", "rank": 8, "alpha": 16, "data": "a.jsonl"}


def test_example_config_parses():
    cfg = load_config("examples/train/train.json")
    assert [a.rank for a in cfg.adapters] == [8, 32, 128]
    assert cfg.adapters[2].use_rslora and cfg.adapters[2].optimizer.kind == "sgd"
    assert cfg.adapters[0].data.endswith("examples/train/colours.jsonl")


def test_relative_paths_and_defaults(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"adapters": [
        {**ADAPTER, "init_from": "init", "optimizer": {"betas": [0.8, 0.9]}}], "steps": 3}))
    cfg = load_config(str(tmp_path / "t.json"))
    a = cfg.adapters[0]
    assert a.data == str(tmp_path / "a.jsonl") and a.init_from == str(tmp_path / "init")
    assert a.optimizer.betas == (0.8, 0.9) and a.optimizer.kind == "adamw"
    assert cfg.batch_size == 64 and cfg.publish.servers == ()


@pytest.mark.parametrize("raw, message", [
    ({"adapters": [], "steps": 1}, "at least one adapter"),
    ({"adapters": [ADAPTER, ADAPTER], "steps": 1}, "unique"),
    ({"adapters": [{**ADAPTER, "lr": 1}], "steps": 1}, r"unknown field\(s\) \['lr'\]"),
    ({"adapters": [{**ADAPTER, "optimizer": {"kind": "adam"}}], "steps": 1}, "'adamw' or 'sgd'"),
    ({"adapters": [{**ADAPTER, "name": "a@1"}], "steps": 1}, "kept for versions"),
    ({"adapters": [{**ADAPTER, "rank": 0}], "steps": 1}, "positive integer"),
    ({"adapters": [{**ADAPTER, "samples_per_step": 0}], "steps": 1}, "samples_per_step"),
    ({"adapters": [ADAPTER], "steps": 0}, "steps and batch_size"),
    ({"adapters": [ADAPTER]}, "steps"),
])
def test_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
