"""The probe runs wherever a push runs (issue 40 item 3), here in the Ray trainer: two rank actors
(FSDP2 over gloo, a tiny Llama sharded per decoder layer) push into two reference-engine actors,
one of which runs an engine whose load path scales a weight after every commit. Every rank joins
the probe's sharded forward pass and rank 0 compares: the good engine passes with float noise, the
faulty one fails at stage `probe` and refuses gated requests. The same push without the probe is
the negative control: every byte check passes while the faulty engine computes with other
weights, so only the probe can make the assertions of the probed pushes hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from weightsync_ray.testing import (CAUSAL_POLICY, count_eval_forwards, eval_forwards,
                                    mismatches, write_causal_checkpoint)

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

FAULTY = Path(__file__).parent / "faulty_engine.py"
CORRUPTED = "model.layers.0.mlp.down_proj.weight"      # what faulty_engine.py scales (x3)
NAMESPACE = "weightsync-tests"
SYNC = {"progress": "off", "lease": 10, "deadline": 120, "failure_policy": "continue"}
EXPORTER = {"kind": "torch", "options": {"bucket_bytes": 65536}}     # several buckets a version


def faulty_launch(model: Path) -> Any:
    """The faulty engine, started by its actor as `weightsync serve` would be."""
    from weightsync_ray.launch import EngineLaunch
    return EngineLaunch(model=str(model), command=[
        "{python}", str(FAULTY), "serve", "--model", "{model}", "--host", "{host}",
        "--port", "{port}", "--name", "{name}", "--device", "cpu"])


def health(url: str) -> dict[str, Any]:
    r = requests.get(url + "/health", timeout=30)
    r.raise_for_status()
    return r.json()


def gated(url: str, version: int) -> int:
    """The status of a generation that asks for at least `version` and waits for nothing."""
    body = {"input_ids": [1, 5, 7], "max_new_tokens": 1, "min_version": version, "wait": 0}
    return requests.post(url + "/generate", json=body, timeout=60).status_code


def start_trainer(fleet: str, probe: str, cleanup: list[Callable[[], Any]]) -> Any:
    from weightsync_ray.trainer import RayTrainer
    config = {"fleet": {"kind": "ray", "options": {"name": fleet, "namespace": NAMESPACE}},
              "transport": "http", "exporter": EXPORTER,
              "sync": {**SYNC, "probe": {"mode": probe}}}
    trainer = RayTrainer(2, config, resources={"trainer": 1}, backend="gloo", **CAUSAL_POLICY)
    cleanup.append(trainer.shutdown)
    return trainer.start()


def test_every_rank_probes_a_ray_trainers_push_and_a_corrupting_engine_fails_it(
        cluster: dict[str, str], cleanup: list, tmp_path: Path) -> None:
    import ray

    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch
    from weightsync_ray.roster import start_fleet, stop_fleet

    model = write_causal_checkpoint(tmp_path / "model")
    fleet = "probe"
    start_fleet(fleet, NAMESPACE, lease=3, timeout=180)
    cleanup.append(lambda: stop_fleet(fleet, NAMESPACE))
    engines = [start_engine("good", EngineLaunch(model=str(model)), fleet=(fleet, NAMESPACE),
                            resources={"engine": 1}, log_dir=str(tmp_path)),
               start_engine("faulty", faulty_launch(model), fleet=(fleet, NAMESPACE),
                            resources={"engine": 1}, log_dir=str(tmp_path))]
    cleanup.append(lambda: stop_actors(engines))
    urls = {i["name"]: i["url"] for i in wait_ready(engines, timeout=180)}

    # the negative control: without the probe, the faulty engine passes every check a push makes
    blind = start_trainer(fleet, "off", cleanup)
    report = blind.train_and_push(1)
    assert report.ok and report.probe is None, report.summary()
    assert all(o.status == "verified" and o.probe is None for o in report.engines.values())
    weights = blind.weights()
    assert mismatches(urls["good"], weights) == []
    assert mismatches(urls["faulty"], weights) == [CORRUPTED]    # yet it holds other weights
    assert health(urls["faulty"])["distrusted"] is None and gated(urls["faulty"], 1) == 200
    blind.shutdown()                   # frees the head node's two trainer slots

    # with the probe (its default, "auto"): every push is probed, and every rank runs its forward
    trainer = start_trainer(fleet, "auto", cleanup)
    ray.get([r.__ray_call__.remote(count_eval_forwards) for r in trainer.ranks], timeout=60)
    for v in (2, 3, 4):
        report = trainer.train_and_push(v)
        good, bad = report.engines["good"], report.engines["faulty"]
        assert report.probe == "2 engines probed with 24 tokens", report.summary()
        assert good.ok and good.status == "verified" and good.version == v, report.summary()
        assert good.probe is not None and good.probe["version"] == v and good.probe["max"] < 1e-4
        assert report.failed == ["faulty"] and bad.stage == "probe" and bad.version == v
        assert bad.probe is not None and bad.probe["version"] == v and bad.probe["max"] > 0.05
        assert "does not compute with the pushed weights" in (bad.error or "")
        assert f"faulty failed at probe (holds version {v})" in report.summary()
        # one sharded forward per push on each rank: rank 0's, and the follower's that it needs
        assert ray.get([r.__ray_call__.remote(eval_forwards) for r in trainer.ranks],
                       timeout=60) == [v - 1, v - 1]

    assert health(urls["good"])["distrusted"] is None and gated(urls["good"], 4) == 200
    distrusted = health(urls["faulty"])["distrusted"]
    assert distrusted is not None and distrusted["version"] == 4
    assert gated(urls["faulty"], 4) == 409          # it serves no gated request now
    weights = trainer.weights()
    assert mismatches(urls["good"], weights) == []
    assert mismatches(urls["faulty"], weights) == [CORRUPTED]
