"""TRL's own trainers run `train()` for a few steps against the two live vLLM servers, with
weightsync pushing every sync, and end in sync: after `train()` both servers report the final
version, hold the trained bytes (read back) and compute the trained model's logprobs (not those
of the weights before the last optimizer step). AsyncGRPOTrainer over a registry fleet,
RLOOTrainer, and GRPOTrainer run twice against the same servers (the rerun's versions continue
above what the servers hold).

Nothing of TRL's driver is re-implemented here. AsyncGRPOTrainer needs two stand-ins on a CPU,
named in `trl_helpers`: its FlashAttention-3 kernel (CUDA-only, fetched from the Hub) and the
CUDA device-name lookup for its MFU metric."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="TRL is not installed here: `make trl-env` installs it into .venv")

import torch  # noqa: E402 - after the skip
from transformers import TrainerCallback  # noqa: E402
from weightsync_trl import WeightSyncTransfer, use_weightsync  # noqa: E402
from weightsync_vllm.generation import parse_version  # noqa: E402

# the async trainer's rollout process is spawned: it imports the reward by name, from the
# sys.path it inherits
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_helpers as h  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 2


class LastStep(TrainerCallback):
    """The weights as the last optimizer step began: what the servers held after `train()`
    before the final push existed."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.before = h.snapshot(model)


def _data(conversational: bool = False) -> Any:
    from datasets import Dataset
    from weightsync_vllm.launch import SENTENCES
    prompts: list[Any] = ([[{"role": "user", "content": s}] for s in SENTENCES] if conversational
                          else SENTENCES * 2)
    return Dataset.from_dict({"prompt": prompts})


def test_fresh_servers_report_default_and_weightsync_reads_0(pair: Any) -> None:
    """Before any push vLLM 0.32 answers `GET /weight_info` with "default": version 0, the checkpoint
    the server started from, so a first run's versions start at 1."""
    assert pair.fresh == {"vllm-a": "default", "vllm-b": "default"}
    assert parse_version("default") == 0


def test_async_grpo_trainer_trains_over_a_registry_fleet_and_ends_in_sync(
        pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncGRPOTrainer's own train(): its rollout process generates from server A, weights go to
    both servers (registered with the transfer's registry). 3 steps, a sync every 2: train begin
    (v1), after step 2 (v2), and the final sync after step 3 (v3) that `attach` adds. Two pieces
    of TRL cannot run on this CPU and are replaced (`trl_helpers.run_async_grpo_on_cpu`): the
    FlashAttention-3 varlen kernel its packed forward calls (a CUDA build fetched from the Hub)
    and `torch.cuda.get_device_name` behind its MFU metric."""
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from weightsync.fleets.member import Membership
    pair.reset()
    h.run_async_grpo_on_cpu(monkeypatch)
    key = "fleet-key"
    wt = WeightSyncTransfer({"fleet": {"kind": "registry", "options": {"api_key": key}},
                             "sync": {"progress": "off"}})
    wt.init_weight_transfer()            # the registry, for the servers to join (train() reuses it)
    members = [Membership(wt.fleet_url, key, {**s.spec(), "adapter": {"kind": "vllm"}},
                          version=lambda: None).start() for s in pair.servers]
    tok = AutoTokenizer.from_pretrained(pair.model_dir)
    tok.response_template = h.RESPONSE_TEMPLATE
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                           vllm_server_base_url=pair.servers[0].url, per_device_train_batch_size=4,
                           num_generations=2, max_completion_length=8, max_steps=3,
                           weight_sync_steps=2, token_budget=0, queue_maxsize=8, max_inflight_tasks=4,
                           learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                           seed=0)
    last = LastStep()
    try:
        trainer = AsyncGRPOTrainer(model=str(pair.model_dir.resolve()), reward_funcs=h.crc_reward,
                                   args=args, train_dataset=_data(conversational=True),
                                   processing_class=tok, callbacks=[last], weight_transfer=wt)
        wt.attach(trainer)
        trainer.train()
    finally:
        for m in members:
            m.stop()
        wt.destroy()
    assert trainer.state.global_step == 3 and trainer.model_version == 3
    for server in pair.servers:      # paused as TRL pauses: what was in flight goes on after
        assert "POST /pause?mode=keep" in Path(server.log).read_text()
    assert [r.version for r in wt.reports] == [1, 2, 3]
    for r in wt.reports:
        assert r.ok and r.verified and sorted(r.engines) == ["vllm-a", "vllm-b"], r.summary()
    trained = h.snapshot(trainer.accelerator.unwrap_model(trainer.model))
    h.assert_final_policy(pair.servers, pair.model_dir, trained, last.before, 3)
    # step 1 trains on samples vLLM generated from v1 (the same weights): the trainer's logprobs,
    # through the stand-in kernel, equal the sampled ones
    first = trainer.state.log_history[0]
    assert first["step"] == 1 and first["sample/staleness_max"] == 0, first
    assert abs(first["ratio"] - 1) < 1e-3 and abs(first["kl"]) < 1e-4, first
    logged = [x["weightsync/version"] for x in trainer.state.log_history if "weightsync/version" in x]
    assert logged == [1.0, 2.0]     # logged at steps 1 and 2; the final sync runs after the last log


def _train(pair: Any, out: Path, kind: str) -> tuple[Any, list[int], LastStep]:
    """One run of a user's script: `use_weightsync`, TRL's trainer in vLLM server mode, train()."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    config_cls, trainer_cls = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[kind]
    installed = use_weightsync({"engines": pair.specs(), "sync": {"progress": "off"}})
    last = LastStep()
    try:
        args = config_cls(output_dir=str(out), use_cpu=True, bf16=False, use_vllm=True,
                          vllm_mode="server", vllm_server_base_url=pair.servers[0].url,
                          vllm_server_timeout=30, per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=8, max_steps=STEPS, learning_rate=1e-2,
                          logging_steps=1, report_to="none", save_strategy="no", seed=0,
                          dataloader_num_workers=0)
        trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(pair.model_dir, dtype=torch.float32),
                              reward_funcs=h.crc_reward, args=args, train_dataset=_data(),
                              processing_class=AutoTokenizer.from_pretrained(pair.model_dir),
                              callbacks=[last])
        trainer.train()
    finally:
        installed.undo()
    reports = installed.sessions[-1].reports
    for r in reports:
        assert r.ok and r.verified and sorted(r.engines) == ["vllm-a", "vllm-b"], r.summary()
        # the probe ran on TRL's own policy model: both servers compute what the trainer does
        assert r.probe == "2 engines probed with 24 tokens", r.probe
        assert all(o.probe["version"] == r.version and o.probe["max"] < 1e-3
                   for o in r.engines.values()), r.summary()
    return trainer, [r.version for r in reports], last


def test_rloo_trainer_trains_and_ends_in_sync(pair: Any, tmp_path: Path) -> None:
    """RLOOTrainer's own train() (same seam as GRPOTrainer): a push at each step's start (v1, v2)
    and the final push after the last step (v3)."""
    pair.reset()
    trainer, versions, last = _train(pair, tmp_path, "rloo")
    assert trainer.state.global_step == STEPS and versions == [1, 2, STEPS + 1]
    h.assert_final_policy(pair.servers, pair.model_dir, h.snapshot(trainer.model), last.before,
                          STEPS + 1)


def test_grpo_rerun_against_running_servers_continues_above_and_ends_in_sync(
        pair: Any, tmp_path: Path) -> None:
    """The same script twice against the same servers: the second run starts above what they
    hold (v4, not a refused v1), and each run ends with its final policy on both servers."""
    pair.reset()
    first, versions, last = _train(pair, tmp_path / "1", "grpo")
    assert versions == [1, 2, 3]
    h.assert_final_policy(pair.servers, pair.model_dir, h.snapshot(first.model), last.before, 3)
    second, versions, last = _train(pair, tmp_path / "2", "grpo")
    assert versions == [4, 5, 6]
    h.assert_final_policy(pair.servers, pair.model_dir, h.snapshot(second.model), last.before, 6)
