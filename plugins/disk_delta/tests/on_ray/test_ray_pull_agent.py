"""A publish-only fleet on a real multi-node Ray cluster (three raylets on this machine): the
trainer publishes disk_delta deltas into a shared root and a pull-agent actor per engine node
(`weightsync_disk_delta.ray_agent`) applies them and reloads that node's engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from weightsync_ray.testing import POLICY, mismatches, write_initial_checkpoint
from weightsync_disk_delta.ray_agent import start_agent

pytestmark = pytest.mark.slow
SYNC = {"progress": "off", "lease": 3, "deadline": 60, "failure_policy": "continue"}
EXPORTER = {"kind": "torch", "options": {"bucket_bytes": 16384}}      # several buckets a version


def start_fleet(name: str, cleanup: list[Callable[[], Any]]) -> Any:
    from weightsync_ray.roster import start_fleet, stop_fleet
    handle = start_fleet(name, "weightsync-tests", lease=3, timeout=180)
    cleanup.append(lambda: stop_fleet(name, "weightsync-tests"))
    return handle


def wait_for(read: Callable[[], Any], want: Any, timeout: float) -> Any:
    """Poll `read()` until it returns `want` or `timeout` passes; the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_publish_only_fleet_with_a_pull_agent_actor_per_node(
        cluster: dict[str, str], cleanup: list, tmp_path: Path) -> None:
    """The trainer publishes deltas into a shared root; an agent actor per engine node applies
    them to a node-local checkpoint and reloads that node's engine. Node b's agent joins at
    version 3 (it builds the newest full version and the deltas after it); node a's agent is
    killed at version 4 and Ray restarts it."""
    import ray

    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch
    from weightsync_ray.trainer import RayTrainer

    model = write_initial_checkpoint(tmp_path / "model")
    root = tmp_path / "published"
    local = {n: tmp_path / f"local-{n}" for n in ("a", "b")}
    fleet = start_fleet("publish", cleanup)
    engines = {n: start_engine(f"p{n}", EngineLaunch(model=str(model), load_roots=[str(local[n])]),
                               resources={f"node_{n}": 1}, log_dir=str(tmp_path))
               for n in ("a", "b")}
    cleanup.append(lambda: stop_actors(list(engines.values())))
    agents: dict[str, Any] = {}
    cleanup.append(lambda: stop_actors(list(agents.values())))

    def agent(n: str, url: str) -> Any:
        return start_agent(f"host-{n}", str(root), str(local[n]), engine_url=url,
                           fleet=("publish", "weightsync-tests"), resources={f"node_{n}": 1},
                           log_dir=str(tmp_path))

    config = {"fleet": {"kind": "ray", "options": {"name": "publish",
                                                   "namespace": "weightsync-tests"}},
              "encoding": "delta",
              "transport": {"kind": "disk_delta", "options": {"root": str(root)}},
              "exporter": EXPORTER, "sync": SYNC}
    trainer = RayTrainer(2, config, resources={"trainer": 1}, **POLICY)
    cleanup.append(trainer.shutdown)
    trainer.start()
    ready = wait_ready(list(engines.values()), timeout=180)
    urls = {n: i["url"] for n, i in zip(engines, ready, strict=True)}
    agents["a"] = agent("a", urls["a"])
    for v in range(1, 7):
        report = trainer.train_and_push(v)
        assert report.ok and report.published and not report.engines, report.summary()
        if v == 3:
            agents["b"] = agent("b", urls["b"])            # a host that joins late
        if v == 4:
            ray.get(agents["a"].ready.remote(120, 4), timeout=180)
            ray.kill(agents["a"], no_restart=False)        # Ray restarts it; it goes on

    weights = trainer.weights()
    for n in ("a", "b"):
        info = wait_ready([agents[n]], timeout=180, min_version=6)[0]
        assert info["version"] == 6 and info["node_id"] == cluster[n]
        assert mismatches(urls[n], weights) == []
    assert ray.get(agents["a"].info.remote())["restarted"]
    # the fleet view is as fresh as each agent's last heartbeat: wait (bounded) for the one after
    # the agents reached version 6
    want = {"host-a": ("host", 6), "host-b": ("host", 6)}
    seen = wait_for(lambda: {m["name"]: (m["role"], m["version"])
                             for m in ray.get(fleet.view.remote())["members"]}, want, timeout=60)
    assert seen == want
