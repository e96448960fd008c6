"""With disk_delta installed, its pull agent reloads SGLang through /update_weights_from_disk on
the host-local checkpoint (issue acceptance 2): trainer publishes deltas, the agent applies them
locally and calls the sglang adapter's load_from_disk; the stand-in ends bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from weightsync.config import EngineSpec
from weightsync.sync.pipeline import WeightSync
from weightsync.testing.sample import perturb
from weightsync_sglang.adapter import SGLangAdapter

agent_mod = pytest.importorskip("weightsync_disk_delta.agent",
                                reason="weightsync-disk_delta is not installed; the agent is its")


def test_agent_reloads_sglang_from_host_local_checkpoint(start_standin, model_sd, tmp_path: Path) -> None:
    engine = start_standin(admin_key="k")
    adapter = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    root = tmp_path / "published"
    cfg = {"encoding": {"kind": "delta"}, "transport": {"kind": "disk_delta", "options": {"root": str(root)}},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}, "sync": {"progress": "off"}}
    agent = agent_mod.Agent(root, tmp_path / "local", adapter)
    sd = model_sd
    with WeightSync.from_config(cfg) as sync:
        for v in (1, 2, 3):
            sd = perturb(sd, v)
            sync.push(sd, version=v)
            local, engine_v = agent.step()
            assert local == v and engine_v == v
            assert engine.weight_version() == str(v)
            got = engine.weights()
            for n, t in sd.items():
                assert got[n].dtype == t.dtype and got[n].equal(t), f"{n} differs at version {v}"
    # SGLang was pointed at the host-local checkpoint, not at the published directory
    info = requests.get(engine.url + "/model_info", timeout=10).json()
    assert Path(info["model_path"]).is_relative_to(tmp_path / "local"), info["model_path"]
