"""Step-latency models: exact recovery, Toppings' forms, profile files."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_loraserve.perf.model import (
    Profile,
    Sample,
    Step,
    StepModel,
    default_profile,
    fit,
    samples_from_json,
    samples_to_json,
    toppings_r2,
)

TRUE = {"intercept": 0.005, "prefill_tokens": 2e-5, "decode_tokens": 4e-5, "lora": 3e-7}


def _samples(kind, noise=0.0, seed=0, coef=TRUE):
    rng = np.random.default_rng(seed)
    model = StepModel(kind, coef)
    out = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for mix in ([8], [128], [8, 16, 32, 64, 128], [8, 128]):
            ranks = tuple((mix * b)[:b])
            out.append(Step(decode=ranks))
            for p in (64, 256):
                out.append(Step(prefill=tuple((p, r) for r in ranks)))
    return [Sample(s, model.predict(s) * (1 + noise * rng.standard_normal())) for s in out]


@pytest.mark.parametrize("kind", ["mbgmv", "bgmv"])
def test_fit_recovers_the_generating_model(kind):
    model, r2 = fit(_samples(kind), kind)
    assert r2 == pytest.approx(1.0)
    for k, v in TRUE.items():
        assert model.coef[k] == pytest.approx(v, rel=1e-6)


def test_fit_is_non_negative_and_r2_drops_with_noise():
    model, r2 = fit(_samples("mbgmv", noise=0.3, seed=1), "mbgmv")
    assert all(v >= 0 for v in model.coef.values())
    assert 0 < r2 < 0.999


def test_lora_terms():
    step = Step(prefill=((100, 8), (50, 64)), decode=(16, 128))
    assert step.lora("mbgmv") == 100 * 8 + 50 * 64 + 16 + 128
    assert step.lora("bgmv") == (150 + 2) * 128
    with pytest.raises(ValueError, match="unknown kernel kind"):
        step.lora("cuda")


def test_toppings_forms_distinguish_kernels():
    """With Toppings' own decode form (a * lora + b, no per-request term),
    each kernel's data is fitted exactly by its form and worse by the other."""
    toppings_like = {**TRUE, "decode_tokens": 0.0}
    r2_b = toppings_r2(_samples("bgmv", coef=toppings_like))
    r2_m = toppings_r2(_samples("mbgmv", coef=toppings_like))
    assert r2_b["decode_bgmv"] == pytest.approx(1.0) and r2_b["decode_mbgmv"] < 0.9
    assert r2_m["decode_mbgmv"] == pytest.approx(1.0) and r2_m["decode_bgmv"] < 0.9
    assert r2_m["prefill_mbgmv"] == pytest.approx(1.0) and r2_m["prefill_bgmv"] < 0.99


def test_profile_round_trip(tmp_path):
    p = default_profile()
    p.operating_points = {8: 123.0, 128: 45.0}
    p.fit_r2 = {"all_steps": 0.9}
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p
    s = _samples("mbgmv")[:5]
    assert samples_from_json(samples_to_json(s)) == s


def test_step_model_validates():
    with pytest.raises(ValueError, match="lacks coefficients"):
        StepModel("mbgmv", {"intercept": 1.0})
