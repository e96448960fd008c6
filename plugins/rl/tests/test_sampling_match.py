"""The trainer computes its side of the gap and of the importance ratio from the distribution
the engine sampled from: at temperature 0.7 (with top-k and top-p on) the reference engine's
logprobs and the trainer's agree to float precision, and a trainer that ignores the temperature
is caught by the gap. Against a real reference-engine process."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from weightsync_reference.models import build_tiny_model, load_trainer_model
from weightsync_reference.processes import EngineProcess
from weightsync_rl import grpo
from weightsync_rl.rollout import RolloutClient, SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, Path]]:
    d = tmp_path_factory.mktemp("sampling")
    build_tiny_model(d / "m", "llama", vocab=128)
    eng = EngineProcess(d / "m", name="e", log=d / "e.log").start(timeout=120)
    yield eng, d / "m"
    eng.stop()


@torch.no_grad()
def _gap(model: torch.nn.Module, batch: grpo.Batch) -> float:
    return grpo.gap(grpo.token_logprobs(model, batch), batch)["max"]


def test_the_gap_at_temperature_0_7_is_float_noise_and_a_wrong_temperature_shows(
        engine: tuple[EngineProcess, Path]) -> None:
    eng, model_dir = engine
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    with RolloutClient([eng.spec()]) as client:
        samples = client.sample([[1, 5, 9], [2, 7]], params)
    assert {s.temperature for s in samples} == {0.7}     # the engine's logprobs: scaled only
    batch = grpo.make_batch(samples, [0.0] * len(samples))
    model = load_trainer_model(model_dir).eval()
    assert _gap(model, batch) < 1e-4
    wrong = grpo.Batch(**{**batch.__dict__, "temperature": torch.ones_like(batch.temperature)})
    assert _gap(model, wrong) > 0.05                        # the gap sees the temperature


def test_processed_logprobs_renormalise_over_top_k_and_top_p() -> None:
    """`grpo.processed` keeps what vLLM's `processed_logprobs` keep: the k largest (ties kept),
    then the smallest set whose probability reaches top_p, renormalised."""
    logits = torch.tensor([[[2.0, 1.0, 0.5, 0.0, -1.0]]])
    one = torch.ones(1)
    lp = grpo.processed(logits, 2 * one, torch.tensor([3]), one)
    kept = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5]) / 2, -1)
    assert torch.allclose(lp[0, 0, :3], kept) and torch.isinf(lp[0, 0, 3:]).all()
    p = torch.softmax(logits[0, 0], -1)                     # 0.55, 0.20, 0.12, 0.07, 0.03
    lp = grpo.processed(logits, one, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(lp[0, 0, :2]).all() and torch.isinf(lp[0, 0, 2:]).all(), p
    assert torch.allclose(lp[0, 0, :2], torch.log(p[:2] / p[:2].sum()))
