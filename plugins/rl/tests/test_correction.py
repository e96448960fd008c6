"""Rollout correction in the loop: the importance weights of truncated and masked IS, token and
sequence level, with the share of tokens cut and the engine-to-trainer KL per step; then a real
async loop (a reference engine process) whose off-policy steps report them."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync import WeightSync
from weightsync_reference.models import build_tiny_model, load_trainer_model
from weightsync_reference.processes import EngineProcess
from weightsync_rl import CountingTask, grpo
from weightsync_rl.loop import RLLoop
from weightsync_rl.rollout import RolloutClient, SamplingParams


def _batch(log_ratios: list[list[float]]) -> tuple[torch.Tensor, grpo.Batch]:
    """Two sequences of three sampled tokens whose trainer/engine log ratios are given."""
    r = torch.tensor(log_ratios)
    b, t = r.shape
    engine = torch.full((b, t), -1.0)
    z = torch.zeros(b)
    batch = grpo.Batch(torch.zeros(b, t + 1, dtype=torch.long), torch.ones(b, t), engine,
                       torch.ones(b, t + 1, dtype=torch.long), z, z + 1, z.long(), z + 1)
    return engine + r, batch


def test_each_correction_weighs_and_counts_as_it_says() -> None:
    prox, batch = _batch([[math.log(3.0), 0.0, 0.0], [math.log(0.5), math.log(0.5), 0.0]])
    w, st = grpo.correction(prox, batch, "token_truncate", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1, 1], [0.5, 0.5, 1]]))
    assert st["corrected"] == pytest.approx(1 / 6)
    w, _ = grpo.correction(prox, batch, "token_mask", cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1, 1], [0.5, 0.5, 1]]))
    w, st = grpo.correction(prox, batch, "sequence_truncate", cap=2.0)    # ratios 3 and 0.25
    assert torch.allclose(w, torch.tensor([[2.0, 2, 2], [0.25, 0.25, 0.25]]))
    assert st["corrected"] == pytest.approx(3 / 6)
    w, _ = grpo.correction(prox, batch, "sequence_mask", cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0, 0], [0.25, 0.25, 0.25]]))
    w, st = grpo.correction(prox, batch, "none", cap=2.0)
    assert torch.equal(w, torch.ones(2, 3)) and st["corrected"] == 0.0
    d = torch.tensor([-math.log(3.0), math.log(2.0), math.log(2.0)])   # log engine/trainer
    assert st["kl"] == pytest.approx(float((d.exp() - 1 - d).sum() / 6), rel=1e-5)
    _, same = grpo.correction(batch.engine_lp, batch, "token_truncate")
    assert same == {"corrected": 0.0, "kl": 0.0}
    with pytest.raises(ValueError, match="use one of token_truncate"):
        grpo.correction(prox, batch, "clip")


def rollouts_before_pushes(sync: WeightSync, sample: Any, steps: int) -> Any:
    """Hold the loop's k-th push until the rollouts it requested before it (k + 1 of them, the
    last push k) came back, so every later step trains on samples exactly one version old: on a
    loaded machine the engine may otherwise serve them after the swap, on the new version."""
    done, cond, pushes = [0], threading.Condition(), [0]
    push = sync.push

    def counted(*args: Any, **kw: Any) -> Any:
        try:
            return sample(*args, **kw)
        finally:
            with cond:
                done[0] += 1
                cond.notify_all()

    def held(*args: Any, **kw: Any) -> Any:
        pushes[0] += 1
        need = min(pushes[0] + 1, steps)
        with cond:
            assert cond.wait_for(lambda: done[0] >= need, 120), f"rollout {need} never came"
        return push(*args, **kw)
    sync.push = held  # type: ignore[method-assign]
    return counted


def test_an_async_loop_reports_what_its_correction_cut(tmp_path: Path) -> None:
    """One step off-policy: the first step trains on its own version (nothing cut, KL 0 up to
    float noise); the later ones on samples a version old, where `token_mask` at a cap of 1.02
    drops some tokens and the KL is positive."""
    build_tiny_model(tmp_path / "m", "llama", vocab=128)
    eng = EngineProcess(tmp_path / "m", name="e", log=tmp_path / "e.log").start(timeout=120)
    try:
        cfg = {"engines": [eng.spec()], "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": "64KiB"}}}
        with WeightSync.from_config(cfg) as sync, RolloutClient([eng.spec()]) as client:
            model = load_trainer_model(tmp_path / "m")
            # weight decay moves the weights every step, even one whose advantages are all 0
            opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
            sampler = rollouts_before_pushes(sync, client.sample, steps=3)
            loop = RLLoop(model, opt, sync, sampler, CountingTask(seed=1),
                          SamplingParams(n=4, max_new_tokens=6, seed=1), prompts_per_step=2,
                          mode="async", epochs=1, correction="token_mask", correction_cap=1.02)
            stats = list(loop.run(steps=3))
        first, *later = stats
        assert first.corrected == 0.0 and first.kl < 1e-5, first
        assert [s.staleness for s in later] == [1.0, 1.0]
        assert all(0 < s.corrected < 1 and s.kl > 1e-5 for s in later), later
        with pytest.raises(ValueError, match="correction 'tis'"):
            RLLoop(model, opt, None, client.sample, CountingTask(), SamplingParams(),
                   correction="tis")
    finally:
        eng.stop()
