"""`loraserve profile`: measure an engine's step latency and fit the model.

The engine is vLLM's offline `LLM` built in this process (add
`additional_config={"loraserve": {}}` to measure the plugin). Batches are
controlled exactly: B requests with fixed prompts of P random tokens, each
with an adapter of a chosen rank, all submitted in one `generate` call with
`ignore_eos`:

- prefill points: `max_tokens=1`, B * P within the token budget, so the
  batch's prompts are one step; the call's time is that step (plus per-call
  overhead, which the intercept absorbs);
- decode points: the same batch once with `max_tokens=1` and once with
  `max_tokens=K+1`; the difference divided by K is one decode step of B
  requests.

Each point is measured `repeats` times (median). The fitted model, Toppings'
R^2 forms and per-rank operating points go to the profile file; the raw
samples go beside it (`*.samples.json`).
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_loraserve.perf.model import (
    Profile,
    Sample,
    Step,
    fit,
    samples_to_json,
    toppings_r2,
)

DECODE_STEPS = 16


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" or "decode"
    prompt_len: int
    ranks: tuple[int, ...]  # adapter rank of each request in the batch


def design(ranks: Sequence[int], batch_sizes: Sequence[int], prompt_lens: Sequence[int],
           max_batched_tokens: int, decode_prompt_len: int = 16) -> list[Point]:
    """Homogeneous batches of every rank plus one mixed batch per size."""
    mixes = [[r] for r in ranks] + ([list(ranks)] if len(ranks) > 1 else [])
    points = []
    for b, mix in itertools.product(batch_sizes, mixes):
        batch = tuple(itertools.islice(itertools.cycle(mix), b))
        points.append(Point("decode", decode_prompt_len, batch))
        for p in prompt_lens:
            if b * p <= max_batched_tokens:
                points.append(Point("prefill", p, batch))
    return points


def measure(llm, adapters: dict[int, tuple[str, str]], points: Sequence[Point],
            repeats: int = 3, seed: int = 0, progress=None) -> list[Sample]:
    """Time every point on `llm`; `adapters` maps rank -> (name, path)."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    ids = {rank: i + 1 for i, rank in enumerate(sorted(adapters))}

    def run(point: Point, max_tokens: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab)
                                                  for _ in range(point.prompt_len)])
                   for _ in point.ranks]
        loras = [LoRARequest(adapters[r][0], ids[r], adapters[r][1]) for r in point.ranks]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - t0

    for r in adapters:  # first use loads each adapter: keep that out of the timings
        run(Point("prefill", 4, (r,)), 2)
    samples = []
    for point in points:
        if point.kind == "prefill":
            seconds = statistics.median(run(point, 1) for _ in range(repeats))
            step = Step(prefill=tuple((point.prompt_len, r) for r in point.ranks))
        else:
            diffs = [run(point, DECODE_STEPS + 1) - run(point, 1) for _ in range(repeats)]
            seconds = max(0.0, statistics.median(diffs)) / DECODE_STEPS
            step = Step(decode=point.ranks)
        samples.append(Sample(step, seconds))
        if progress is not None:
            progress.update(1)
    return samples


def profile_engine(llm, adapters: dict[int, tuple[str, str]], *, kind: str, points,
                   repeats: int, adapter_bytes_per_rank: float, slo_ttft_p95_s: float,
                   source: str, samples_path: str | None = None) -> Profile:
    """Measure, fit, derive operating points; returns the profile."""
    from tqdm import tqdm

    from vllm_loraserve.perf.operating import with_operating_points

    config = llm.llm_engine.vllm_config.scheduler_config
    with tqdm(total=len(points), desc="profiling steps") as bar:
        samples = measure(llm, adapters, points, repeats, progress=bar)
    model, r2 = fit(samples, kind)
    if samples_path:
        with open(samples_path, "w") as f:
            json.dump(samples_to_json(samples), f)
    profile = Profile(step=model, max_num_seqs=config.max_num_seqs,
                      max_batched_tokens=config.max_num_batched_tokens,
                      adapter_bytes_per_rank=adapter_bytes_per_rank,
                      slo={"ttft_p95_s": slo_ttft_p95_s}, source=source,
                      fit_r2={"all_steps": r2, **toppings_r2(samples)})
    return with_operating_points(profile, sorted(adapters))
