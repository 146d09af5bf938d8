"""`train.json`: what to train, typed and checked in one place.

    {"adapters": [{"name": "a", "rank": 8, "alpha": 16, "data": "a.jsonl",
                   "optimizer": {"kind": "adamw", "lr": 1e-4}, ...}, ...],
     "steps": 100, "batch_size": 64, "seed": 0, "save_every": 50,
     "publish": {"servers": ["http://127.0.0.1:8000"], "every": 50}}

Relative paths are taken from the file's directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_loraserve.adapters.safety import check_name


class ConfigError(ValueError):
    """A train.json that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class OptimizerConfig:
    kind: str = "adamw"
    """`adamw` or `sgd` (torch.optim.AdamW / SGD, one per adapter)."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW only."""
    eps: float = 1e-8
    """AdamW only."""
    weight_decay: float = 0.0
    momentum: float = 0.0
    """SGD only."""

    def __post_init__(self) -> None:
        if self.kind not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer kind must be 'adamw' or 'sgd', got {self.kind!r}")
        if not self.lr > 0:
            raise ConfigError(f"optimizer lr must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class AdapterTrainConfig:
    name: str
    """Adapter name; published versions are `name@step`."""
    rank: int
    alpha: float
    data: str
    """JSONL of {"prompt", "completion"}; loss on completion tokens only."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_rslora: bool = False
    """Scaling alpha / sqrt(rank) instead of alpha / rank."""
    init_from: str | None = None
    """A PEFT adapter directory to start from (same rank and targets);
    None: PEFT's initialisation (A Kaiming-uniform, B zero) from the seed."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    samples_per_step: int = 8
    """The adapter's optimizer steps once this many of its samples have been
    accumulated (a mixed batch never holds samples past that boundary), on
    the mean of their losses, each sample's loss being the mean cross-entropy
    over its completion tokens (not HF Trainer's mean over all the tokens).
    The end of a run steps on the samples held, if fewer."""

    def __post_init__(self) -> None:
        try:
            check_name(self.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if "@" in self.name:
            raise ConfigError(f"adapter name {self.name!r}: '@' is kept for versions")
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"adapter {self.name}: rank must be a positive integer")
        if not self.target_modules:
            raise ConfigError(f"adapter {self.name}: give at least one target module")
        if self.samples_per_step <= 0:
            raise ConfigError(f"adapter {self.name}: samples_per_step must be positive")


@dataclass(frozen=True)
class PublishConfig:
    servers: tuple[str, ...] = ()
    """Base URLs of `vllm serve --plugin loraserve` servers (runtime load API)."""
    router: str | None = None
    """Base URL of a cluster router (`POST /admin/adapters`)."""
    every: int = 0
    """Publish every this many steps (0: only at the end)."""


@dataclass(frozen=True)
class TrainConfig:
    adapters: tuple[AdapterTrainConfig, ...]
    steps: int
    """Mixed-batch steps."""
    batch_size: int = 64
    """Samples per step, over all adapters."""
    seed: int = 0
    save_every: int = 0
    """Save `out/name@step` every this many steps (0: only at the end)."""
    kernel: str = "torch"
    """Kernel backend (`torch` or `triton`)."""
    publish: PublishConfig = field(default_factory=PublishConfig)

    def __post_init__(self) -> None:
        names = [a.name for a in self.adapters]
        if not names:
            raise ConfigError("list at least one adapter")
        if len(set(names)) != len(names):
            raise ConfigError(f"adapter names must be unique: {names}")
        if self.steps <= 0 or self.batch_size <= 0:
            raise ConfigError("steps and batch_size must be positive")


def _build(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def parse_config(raw: Any, base_dir: str = ".") -> TrainConfig:
    if not isinstance(raw, dict):
        raise ConfigError("train.json must hold a JSON object")
    raw = dict(raw)
    adapters = []
    for i, a in enumerate(raw.pop("adapters", None) or []):
        if not isinstance(a, dict):
            raise ConfigError(f"adapters[{i}]: expected a JSON object")
        a = dict(a)
        where = f"adapters[{i}] ({a.get('name', '?')})"
        opt = a.pop("optimizer", {})
        if isinstance(opt, dict) and "betas" in opt:
            opt = {**opt, "betas": tuple(opt["betas"])}
        for key in ("data", "init_from"):
            if a.get(key) is not None:
                a[key] = os.path.join(base_dir, a[key])
        if "target_modules" in a:
            a["target_modules"] = tuple(a["target_modules"])
        adapters.append(_build(AdapterTrainConfig, {**a, "optimizer": _build(
            OptimizerConfig, opt, f"{where}.optimizer")}, where))
    publish = raw.pop("publish", {})
    if isinstance(publish, dict) and "servers" in publish:
        publish = {**publish, "servers": tuple(publish["servers"])}
    return _build(TrainConfig, {**raw, "adapters": tuple(adapters),
                                "publish": _build(PublishConfig, publish, "publish")},
                  "train.json")


def load_config(path: str) -> TrainConfig:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return parse_config(raw, os.path.dirname(os.path.abspath(path)))
