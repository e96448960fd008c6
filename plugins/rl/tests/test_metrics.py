"""Metrics where RL users look (issue 43 item 6): a two-step RLLoop against a reference engine
process writes each step as a JSON line, to TensorBoard (read back with TensorBoard's own event
reader) and to an offline wandb run (its summary read through wandb's API, its keys in the
offline run's file), under the same
names; a missing extra is refused before any step runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from weightsync import WeightSync
from weightsync.testing.waiting import wait_for
from weightsync_reference.models import build_tiny_model, load_trainer_model
from weightsync_reference.processes import EngineProcess
from weightsync_rl import CountingTask, RLLoop
from weightsync_rl.metrics import MetricsLog, tag
from weightsync_rl.rollout import RolloutClient, SamplingParams

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
pytest.importorskip("wandb", reason="the wandb extra is not installed")


def test_each_step_goes_to_jsonl_tensorboard_and_wandb(tmp_path: Path, monkeypatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    build_tiny_model(tmp_path / "m", "llama", vocab=128)
    model = load_trainer_model(tmp_path / "m")
    cfg = {"sync": {"progress": "off"}, "exporter": {"kind": "torch", "options": {"bucket_bytes": "64KiB"}}}
    log = MetricsLog(tmp_path / "steps.jsonl", tensorboard=tmp_path / "tb",
                     wandb={"project": "weightsync-test", "dir": str(tmp_path)})
    with EngineProcess(tmp_path / "m", name="a", log=tmp_path / "a.log") as eng, \
            WeightSync.from_config({**cfg, "engines": [eng.spec()]}) as sync, \
            RolloutClient([eng.spec()]) as client:
        loop = RLLoop(model, torch.optim.SGD(model.parameters(), lr=1e-3), sync, client.sample,
                      CountingTask(seed=1), SamplingParams(n=2, max_new_tokens=4, seed=1),
                      prompts_per_step=2, metrics=log)
        stats = list(loop.run(steps=2))
    summary = dict(log.run.summary)          # what wandb's run holds, read through its own API
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["weightsync_version"] for r in rows] == [1, 2]
    for r, st in zip(rows, stats):
        assert r["weightsync_rl_reward"] == pytest.approx(st.reward)
        assert r["weightsync_rl_push_ok"] == 1.0 and r["weightsync_rl_samples"] == 4
        assert r['weightsync_logprob_gap{engine="a",stat="max"}'] == pytest.approx(st.gap_max)
    gap = 'weightsync_logprob_gap{engine="a",stat="max"}'
    assert tag(gap) == "weightsync_logprob_gap/engine=a/stat=max"
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for name in ("weightsync_rl_reward", gap):
        got = [(e.step, e.value) for e in acc.Scalars(tag(name))]
        assert got == [(r["step"], pytest.approx(r[name])) for r in rows]
    assert summary["weightsync_rl_reward"] == pytest.approx(rows[-1]["weightsync_rl_reward"])
    assert summary[tag(gap)] == pytest.approx(rows[-1][gap])
    (run,) = Path(tmp_path / "wandb").glob("offline-run-*/run-*.wandb")   # the offline run's log
    # wandb's service process (wandb-core) writes the run's records, and may still be writing
    # them when `run.finish()` returns (once seen: a file of its 7-byte header only, under load)
    wait_for(lambda: tag(gap).encode() in run.read_bytes(), 60, "the offline run's records")


def test_a_missing_extra_is_refused_before_any_step(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from weightsync_rl.metrics import MetricsLog\n"
            "try:\n    MetricsLog(wandb='p')\nexcept ImportError as e:\n    print(e)\n")
    out = os.popen(f"{sys.executable} -c \"{code}\"").read()
    assert out.strip() == "wandb logging needs the wandb package: pip install 'weightsync-rl[wandb]'"
