"""The RL loop against engines that do not go as planned, each a reference engine in its own
process: a commit whose answer is lost, a loop started against engines already ahead of it,
pushes that keep failing, and an engine frozen while it holds the loop's prompts. Versions come from what the engines report; staleness is measured
against the weights being trained."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from weightsync import WeightSync
from weightsync.errors import SyncError
from weightsync_rl import CountingTask
from weightsync_rl.loop import PushesFailed, RLLoop, StepStats
from weightsync_rl.rollout import RolloutClient, SamplingParams
from weightsync_reference.models import build_tiny_model, load_trainer_model
from weightsync_reference.processes import EngineProcess

HERE = Path(__file__).parent
SYNC = {"sync": {"progress": "off"}, "exporter": {"kind": "torch", "options": {"bucket_bytes": "64KiB"}}}
PROMPTS, N = 2, 2                            # 4 samples a step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("loop-faults") / "m"
    build_tiny_model(d, "llama", vocab=128)
    return d


def _loop(model_dir: Path, sync: object, client: RolloutClient, **kw: object) -> RLLoop:
    """A tiny loop whose every step moves the weights (weight decay: even a step whose
    advantages are all 0 changes them), so that each version's weights differ."""
    model = load_trainer_model(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    return RLLoop(model, opt, sync, client.sample, CountingTask(seed=2),
                  SamplingParams(n=N, max_new_tokens=4, seed=1), prompts_per_step=PROMPTS,
                  epochs=1, wait=30.0, **kw)  # type: ignore[arg-type]


def _perturbed(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_a_commit_whose_answer_is_lost_is_trained_on_with_the_weights_it_holds(
        model_dir: Path, tmp_path: Path) -> None:
    """The engine commits version 2 and the trainer's commit call fails: the engine says it
    holds 2 afterwards, so the loop counts the push as landed, keeps its snapshot, and trains
    the next step on samples of version 2 with those weights (a KeyError before)."""
    eng = EngineProcess(model_dir, name="lost", log=tmp_path / "lost.log", env={"LOST_ANSWER_AT": "2"},
                        program=[sys.executable, str(HERE / "lost_answer_engine.py")]).start(timeout=120)
    try:
        with WeightSync.from_config({**SYNC, "engines": [eng.spec()]}) as sync, \
                RolloutClient([eng.spec()]) as client:
            loop = _loop(model_dir, sync, client)
            stats: list[StepStats] = []
            for st in loop.run(steps=3):
                stats.append(st)
                if st.step == 2:         # the engine holds the bytes the loop keeps for 2
                    assert eng.health()["version"] == 2 and eng.holds(loop.snapshots[2])
        first, lost, after = stats
        assert [s.version for s in stats] == [1, 2, 3]
        assert [s.trained_version for s in stats] == [0, 1, 2]
        assert first.push_ok and after.push_ok and not lost.push_ok
        assert lost.error is not None and "at commit" in lost.error, lost.error
        assert "answer to the commit of version 2 was lost" in lost.error
        assert [s.failed_pushes for s in stats] == [0, 0, 0] and loop.version == 3
        # trained on the samples of version 2, measured against the weights pushed as 2
        assert after.samples == PROMPTS * N and after.unknown == 0 and after.dropped == 0
        assert after.staleness == 0.0 and list(after.gaps) == ["lost@2"]
        assert after.gap_max < 1e-4 and after.error is None
    finally:
        eng.stop()


def test_a_loop_started_against_engines_ahead_goes_on_above_the_fleet(
        model_dir: Path, tmp_path: Path) -> None:
    """The engine holds version 5 from an earlier run (other weights); a new trainer's loop
    counts from above it: it pushes its own weights as 6 before any rollout, and trains on
    samples of 6 with a gap of 0 (a KeyError on version 5 before)."""
    eng = EngineProcess(model_dir, name="ahead", log=tmp_path / "ahead.log").start(timeout=120)
    try:
        earlier = load_trainer_model(model_dir)
        _perturbed(earlier, 1)
        with WeightSync.from_config({**SYNC, "engines": [eng.spec()]}) as sync:
            assert sync.push(earlier, version=5).ok
        with WeightSync.from_config({**SYNC, "engines": [eng.spec()]}) as sync, \
                RolloutClient([eng.spec()]) as client:
            assert sync.fleet_version() == 5
            loop = _loop(model_dir, sync, client)
            stats = list(loop.run(steps=2))
        assert loop.resumed == 5 and loop.version == 8 and eng.health()["version"] == 8
        assert [s.trained_version for s in stats] == [6, 7]
        assert [s.version for s in stats] == [7, 8]
        for s, v in zip(stats, (6, 7)):
            assert s.push_ok and s.error is None and s.unknown == 0 and s.failed_pushes == 0
            assert s.samples == PROMPTS * N and s.staleness == 0.0
            assert list(s.gaps) == [f"ahead@{v}"] and s.gap_max < 1e-4
    finally:
        eng.stop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pushes_that_keep_failing_grow_the_staleness_and_stop_the_loop(
        model_dir: Path, tmp_path: Path, mode: str) -> None:
    """The trainer's sync carries a wrong key: every push is refused while rollouts (the right
    key) go on from version 0. Staleness is counted against the weights trained (0, 1, 2), the
    samples beyond max_staleness are dropped, and the third failed push in a row stops the run
    with an error that says so."""
    key = "the-engines-key-0123456789"
    eng = EngineProcess(model_dir, name="f", api_key=key, log=tmp_path / "f.log").start(timeout=120)
    try:
        wrong = {**eng.spec(), "api_key": "not-the-engines-key-0123"}
        with WeightSync.from_config({**SYNC, "engines": [wrong]}) as sync, \
                RolloutClient([eng.spec()]) as client:
            loop = _loop(model_dir, sync, client, mode=mode, max_staleness=1, max_failed_pushes=3)
            stats: list[StepStats] = []
            with pytest.raises(PushesFailed) as e:
                for st in loop.run(steps=10):
                    stats.append(st)
        assert len(stats) == 3 and e.value.stats is stats[-1]
        assert isinstance(e.value, SyncError) and e.value.report is not None
        assert [s.trained_version for s in stats] == [0, 1, 2]
        assert [s.version for s in stats] == [1, 2, 3] and loop.version == 0
        assert [s.staleness for s in stats] == [0.0, 1.0, 2.0]
        assert [s.samples for s in stats] == [PROMPTS * N, PROMPTS * N, 0]
        assert [s.dropped for s in stats] == [0, 0, PROMPTS * N]
        assert [s.failed_pushes for s in stats] == [1, 2, 3]
        assert not any(s.push_ok for s in stats)
        assert all(s.error and "sync of version" in s.error for s in stats)
        assert "nothing to train on" in str(stats[2].error)
        # one version behind: trained on, the gap measured with the weights of version 0
        assert list(stats[1].gaps) == ["f@0"] and stats[1].gap_max < 1e-4
        msg = str(e.value)
        assert msg.startswith("3 pushes in a row were taken by no engine (versions 1, 2, 3)"), msg
        assert "the last: sync of version 3 failed" in msg
        assert "The engines hold version 0, 3 updates behind the trained weights" in msg
        assert "max_failed_pushes=3" in msg
        assert eng.health()["version"] == 0
    finally:
        eng.stop()


def test_a_frozen_engines_prompts_move_and_the_step_goes_on(model_dir: Path, tmp_path: Path) -> None:
    """Engine a is frozen (SIGSTOP) while the loop's first rollouts are spread over a and b:
    the prompts sent to a are cancelled there after the client's `stuck` (2 s) and served by b,
    so the step goes on (before, it waited until a woke); every step trains on b's samples."""
    import os
    import signal
    a = EngineProcess(model_dir, name="a", log=tmp_path / "a.log").start(timeout=120)
    b = EngineProcess(model_dir, name="b", log=tmp_path / "b.log").start(timeout=120)
    assert a.proc is not None
    try:
        os.kill(a.proc.pid, signal.SIGSTOP)
        with WeightSync.from_config({**SYNC, "engines": [b.spec()]}) as sync, \
                RolloutClient([a.spec(), b.spec()], refresh=0.0, stuck=2.0) as client:
            loop = _loop(model_dir, sync, client)
            stats = list(loop.run(steps=2))
        assert [s.samples for s in stats] == [PROMPTS * N] * 2, stats
        assert all(set(s.gaps) <= {"b@0", "b@1"} and s.gaps for s in stats), stats
        assert client.moved >= 1 and [s.push_ok for s in stats] == [True, True]
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        a.stop()
        b.stop()
