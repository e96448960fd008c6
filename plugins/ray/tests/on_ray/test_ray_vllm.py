"""A vLLM server as an engine actor (the built-in `vllm` start command, vLLM's CPU build): it
starts on its node, registers with the fleet actor, and a push reaches it through fleet `ray`,
verified by the `weightsync` backend inside vLLM. Marked `engine`: it needs vLLM installed
(`make vllm-env`) and takes minutes on two cores; run it with `-m engine`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]
NS = "weightsync-tests"


def test_a_vllm_engine_actor_registers_and_is_pushed_to(cluster: dict[str, str], cleanup: list,
                                                         tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    testing = pytest.importorskip("weightsync_vllm.testing")
    import requests
    import torch

    from weightsync import WeightSync
    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.roster import start_fleet, stop_fleet
    from weightsync_ray.launch import EngineLaunch

    model = testing.build_model_dir(tmp_path / "model")
    start_fleet("vllm", NS, lease=10, timeout=180)
    cleanup.append(lambda: stop_fleet("vllm", NS))
    launch = EngineLaunch(model=str(tmp_path / "model"), adapter={"kind": "vllm"}, api_key="vk",
                          args=["--max-model-len", "512", "--kv-cache-memory-bytes",
                                str(512 * 2**20), "--enforce-eager"],
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "VLLM_NO_USAGE_STATS": "1"}, start_timeout=600)
    engine = start_engine("v0", launch, fleet=("vllm", NS), resources={"engine": 1},
                          log_dir=str(tmp_path))
    cleanup.append(lambda: stop_actors([engine]))
    info = wait_ready([engine], timeout=900)[0]
    sync = WeightSync.from_config({"fleet": {"kind": "ray", "options": {"name": "vllm",
                                                                         "namespace": NS}},
                                   "adapter": "vllm", "sync": {"progress": "off"}})
    cleanup.append(sync.close)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    report = sync.push(model, version=1)
    assert report.ok and report.engines["v0"].status == "verified", report.summary()
    got = requests.get(info["url"] + "/weight_info", headers={"Authorization": "Bearer vk"},
                       timeout=30).json()
    assert got["weight_version"] in (1, "1")
