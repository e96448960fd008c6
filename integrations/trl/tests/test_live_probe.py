"""The probe in TRL's setting: GRPOTrainer pushes through weightsync into the two live vLLM
servers, and server B's weights are overwritten after every commit, so B verifies every digest
(the bytes it staged are the ones sent) and then computes with other weights. The probe (run on
TRL's own policy model) fails B at stage "probe" in every push; the report, weightsync's log
line and TRL's logged metrics say so, and server A keeps taking every step.

How B is corrupted: right after the real commit on B (`VllmAdapter.commit`, wrapped for this
test), a second write through a real weight route of the server, the weightsync backend's
reload from disk (`load_from_disk` with `allow_older`), loads a checkpoint whose `lm_head` is
scaled by 3 and labels it with the version just committed: what vLLM then serves is not what
was pushed, and nothing but the probe compares what it computes. Without the probe every push
would end with B `verified` and this test would fail."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="TRL is not installed here: `make trl-env` installs it into .venv")

import torch  # noqa: E402 - after the skip
from weightsync_trl import use_weightsync  # noqa: E402
from weightsync_trl.readback import compare_served  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_helpers as h  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 2
SCALE = 3.0


def _corrupt_checkpoint(model_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """The served checkpoint with `lm_head.weight` scaled: the same names and shapes (the
    backend checks both), other values."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(SCALE)
    model.save_pretrained(out, safe_serialization=True)
    return h.snapshot(model)


def test_probe_fails_a_server_whose_weights_change_after_commit(
        pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from weightsync_vllm.adapter import VllmAdapter
    from weightsync_vllm.launch import SENTENCES

    pair.reset()
    a, b = pair.servers
    corrupt = tmp_path / "corrupt"
    corrupt_weights = _corrupt_checkpoint(pair.model_dir, corrupt)

    commit = VllmAdapter.commit
    overwritten: list[int] = []

    def commit_then_overwrite(self: VllmAdapter, version: int) -> None:
        commit(self, version)
        if self.engine_name == b.name:      # other bytes, under the version just committed
            self.load_from_disk(str(corrupt), version, allow_older=True)
            overwritten.append(version)

    monkeypatch.setattr(VllmAdapter, "commit", commit_then_overwrite)

    class LastStep(TrainerCallback):
        def __init__(self) -> None:
            self.before: dict[str, torch.Tensor] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.before = h.snapshot(model)

    installed = use_weightsync({"engines": pair.specs(), "sync": {"progress": "off"}})
    last = LastStep()
    try:
        tok = AutoTokenizer.from_pretrained(pair.model_dir)
        args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, use_vllm=True,
                          vllm_mode="server", vllm_server_base_url=a.url, vllm_server_timeout=30,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                          max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to="none",
                          save_strategy="no", seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(pair.model_dir, dtype=torch.float32),
                              reward_funcs=h.crc_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": SENTENCES * 2}),
                              processing_class=tok, callbacks=[last])
        with caplog.at_level(logging.WARNING, logger="weightsync"):
            trainer.train()
        reports = list(installed.sessions[-1].reports)
    finally:
        installed.undo()

    # one push per step and the final push, each overwritten on B after its commit
    assert [r.version for r in reports] == [1, 2, 3] and overwritten == [1, 2, 3]
    for r in reports:
        ra, rb = r.engines["vllm-a"], r.engines["vllm-b"]
        assert r.probe == "2 engines probed with 24 tokens", r.summary()
        # A: verified, and computes what the trainer does
        assert ra.ok and ra.status == "verified" and ra.probe is not None, r.summary()
        assert ra.probe["version"] == r.version and ra.probe["max"] < 1e-3, ra
        # B: every digest matched (it failed nowhere before the probe), then the probe failed it
        assert not rb.ok and rb.stage == "probe" and rb.status == "failed", r.summary()
        assert rb.version == r.version and rb.probe is not None and rb.probe["version"] == r.version
        assert rb.probe["max"] > 0.05, rb.probe
        assert "differ from the trainer's" in (rb.error or ""), rb.error
        assert r.failed == ["vllm-b"] and "vllm-b failed at probe" in r.summary()
    # weightsync's log names B and the stage at every push
    named = [rec.getMessage() for rec in caplog.records
             if rec.name == "weightsync.trl" and "vllm-b at probe" in rec.getMessage()]
    assert len(named) == 3, [rec.getMessage() for rec in caplog.records]
    # TRL's own log lines carry the count per step (the final push runs after TRL's last log)
    logged = [x for x in trainer.state.log_history if "weightsync/engines_failed" in x]
    assert [(x["weightsync/engines_ok"], x["weightsync/engines_failed"]) for x in logged] == [(1, 1)] * STEPS
    assert [x["weightsync/version"] for x in logged] == [1, 2]

    # what the servers hold now: A the trained policy, B the overwritten bytes, flagged by the
    # failed probe ("distrusted-3": the rollout sampler reads it as no fitting version)
    trained = h.snapshot(trainer.model)
    h.assert_final_policy([a], pair.model_dir, trained, last.before, 3)
    assert h.served_version(b.url) == "distrusted-3"
    with pytest.raises(AssertionError, match="differs from the trainer's"):
        compare_served(b.url, trained)
    assert h.READ_BACK <= set(compare_served(b.url, corrupt_weights))
    # and computes with them: vLLM's prompt_logprobs are the corrupt checkpoint's (the probe's
    # own call, made here without its version check, which a distrusted version fails)
    got = torch.tensor(_scored(b))
    assert (got - h.model_logprobs(pair.model_dir, corrupt_weights)).abs().max() < h.TOLERANCE


def _scored(server: Any) -> list[float]:
    from weightsync.config import EngineSpec
    from weightsync_vllm.adapter import VllmAdapter, VllmOptions
    from weightsync_vllm.generation import completions, parse_prompt_logprobs, score_body
    spec = EngineSpec(**server.spec())
    adapter = VllmAdapter(VllmOptions(**spec.options), spec)
    try:
        return parse_prompt_logprobs(server.name, completions(adapter, score_body(h.PROBE)), h.PROBE)
    finally:
        adapter.close()
