"""Engine step-latency models (Toppings §5) and the profile file that holds one.

One engine step computes some prompt tokens (prefill, possibly chunked) and
one token for each decoding request. Its latency is modelled as linear in:

    t = b + c_p * prefill_tokens + c_d * decode_tokens + a * lora

with the LoRA term given by the kernel:
- `mbgmv` (S-LoRA's MBGMV/MBGMM, our kernels): the sum over the step's
  tokens of their adapter's rank (cost follows the sum of ranks);
- `bgmv` (Punica's BGMV, padded): the step's tokens times its largest rank.

Toppings' own forms are the restrictions of this model to decode-only steps
(t = a * sum of ranks + b, or a * |batch| * max rank + b) and prefill-only
steps (with the prompt-token term); `toppings_r2` fits and scores all four.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

KINDS = ("mbgmv", "bgmv")
FEATURES = ("intercept", "prefill_tokens", "decode_tokens", "lora")


@dataclass(frozen=True)
class Step:
    """What one engine step computed: prompt chunks and decoding requests,
    each with its adapter's rank (0: no adapter)."""

    prefill: tuple[tuple[int, int], ...] = ()  # (tokens, rank) per prompt chunk
    decode: tuple[int, ...] = ()  # rank per decoding request

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill)

    def lora(self, kind: str) -> float:
        if kind == "mbgmv":
            return sum(n * r for n, r in self.prefill) + sum(self.decode)
        if kind == "bgmv":
            ranks = [r for _, r in self.prefill] + list(self.decode)
            return (self.prefill_tokens + len(self.decode)) * max(ranks, default=0)
        raise ValueError(f"unknown kernel kind {kind!r}; choose from {KINDS}")

    def features(self, kind: str) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, len(self.decode), self.lora(kind)])


@dataclass(frozen=True)
class StepModel:
    kind: str
    coef: Mapping[str, float]  # seconds per unit of each of FEATURES

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kernel kind {self.kind!r}; choose from {KINDS}")
        missing = set(FEATURES) - set(self.coef)
        if missing:
            raise ValueError(f"step model lacks coefficients {sorted(missing)}")

    def predict(self, step: Step) -> float:
        return self.time(step.prefill_tokens, len(step.decode), step.lora(self.kind))

    def time(self, prefill_tokens: float, decode_tokens: float, lora: float) -> float:
        """Step seconds from the features directly (the simulator's hot path)."""
        c = self.coef
        return (c["intercept"] + c["prefill_tokens"] * prefill_tokens
                + c["decode_tokens"] * decode_tokens + c["lora"] * lora)


@dataclass(frozen=True)
class Sample:
    """One measured step: what it computed and how long it took."""

    step: Step
    seconds: float


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Coefficients and R^2 of a non-negative least-squares fit (a step never
    gets cheaper with more work; all-zero columns dropped)."""
    from scipy.optimize import nnls

    used = np.flatnonzero(np.abs(x).sum(axis=0) > 0)
    coef = np.zeros(x.shape[1])
    coef[used] = nnls(x[:, used], y)[0]
    resid = y - x @ coef
    total = ((y - y.mean()) ** 2).sum()
    return coef, float(1 - (resid @ resid) / total) if total > 0 else 1.0


def fit(samples: Sequence[Sample], kind: str) -> tuple[StepModel, float]:
    """Non-negative least-squares step model over all samples, and its R^2."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} samples, got {len(samples)}")
    x = np.stack([s.step.features(kind) for s in samples])
    coef, r2 = _lstsq(x, np.array([s.seconds for s in samples]))
    return StepModel(kind, dict(zip(FEATURES, map(float, coef), strict=True))), r2


def toppings_r2(samples: Sequence[Sample]) -> dict[str, float]:
    """R^2 of Toppings' four linear forms, each on the steps it describes."""
    decode = [s for s in samples if s.step.decode and not s.step.prefill]
    prefill = [s for s in samples if s.step.prefill and not s.step.decode]
    out = {}
    for kind in KINDS:
        if len(decode) >= 3:  # t = a * lora + b
            x = np.stack([[1.0, s.step.lora(kind)] for s in decode])
            out[f"decode_{kind}"] = _lstsq(x, np.array([s.seconds for s in decode]))[1]
        if len(prefill) >= 4:  # t = a * lora + c * prompt tokens + b
            x = np.stack([[1.0, s.step.prefill_tokens, s.step.lora(kind)] for s in prefill])
            out[f"prefill_{kind}"] = _lstsq(x, np.array([s.seconds for s in prefill]))[1]
    return out


@dataclass
class Profile:
    """A step model with the engine limits it was measured under, the adapter
    load costs, and (once computed) per-rank operating points: the most
    tokens/s (prompt + output) one engine sustains within `slo`."""

    step: StepModel
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    adapter_bytes_per_rank: float = 5.0e6  # bytes of one rank-row over all layers
    host_to_device_bytes_per_s: float = 25e9  # adapter load from host memory
    remote_fetch_bytes_per_s: float = 10e9  # adapter fetch from another engine
    slo: dict[str, float] = field(default_factory=lambda: {"ttft_p95_s": 10.0})
    operating_points: dict[int, float] = field(default_factory=dict)
    source: str = ""
    fit_r2: dict[str, float] = field(default_factory=dict)

    def adapter_bytes(self, rank: int) -> float:
        return rank * self.adapter_bytes_per_rank

    def to_json(self) -> dict:
        d = asdict(self)
        d["step"] = {"kind": self.step.kind, "coef": dict(self.step.coef)}
        d["operating_points"] = {str(k): v for k, v in self.operating_points.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> Profile:
        d = dict(d)
        d["step"] = StepModel(d["step"]["kind"], d["step"]["coef"])
        d["operating_points"] = {int(k): float(v) for k, v in d.get("operating_points", {}).items()}
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            return cls.from_json(json.load(f))


def default_profile() -> Profile:
    """The documented default used when no measured profile is given.

    Illustrative round numbers for a ~7B model on one Hopper GPU with
    paged MBGMV kernels, in the same order as docs/benchmarks/kernels.md and
    the stock-vLLM H200 baseline: 6 ms per step, 25 us per prompt token,
    50 us per decoding request, 0.3 us per rank-token of LoRA work; adapter
    rank-rows of 5 MB (Llama-7B, all linear modules, 32 layers, fp16). Not a
    measurement: run `loraserve profile` for one.
    """
    return Profile(
        step=StepModel("mbgmv", {"intercept": 6e-3, "prefill_tokens": 25e-6,
                                 "decode_tokens": 50e-6, "lora": 3e-7}),
        source="default (illustrative; see perf.model.default_profile)",
    )


def samples_from_json(rows: Iterable[Mapping]) -> list[Sample]:
    return [Sample(Step(tuple(map(tuple, r["prefill"])), tuple(r["decode"])), r["seconds"])
            for r in rows]


def samples_to_json(samples: Iterable[Sample]) -> list[dict]:
    return [{"prefill": [list(p) for p in s.step.prefill], "decode": list(s.step.decode),
             "seconds": s.seconds} for s in samples]
