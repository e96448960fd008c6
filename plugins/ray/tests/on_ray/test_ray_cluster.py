"""Issue 16 on a real multi-node Ray cluster (three raylets on this machine): a trainer of two
Ray actors (FSDP2 over gloo) pushes into engine actors that Ray placed, supervises and restarts,
with membership held by a named, detached fleet actor. (The publish-only fleet whose disk_delta
pull agents run as one actor per node is tested with the plugin: plugins/disk_delta/tests/on_ray.)"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from weightsync_ray.testing import POLICY, mismatches, write_initial_checkpoint

pytestmark = pytest.mark.slow
SYNC = {"progress": "off", "lease": 3, "deadline": 60, "failure_policy": "continue"}
EXPORTER = {"kind": "torch", "options": {"bucket_bytes": 16384}}      # several buckets a version


def process_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process `pid` is gone (or a zombie) within `timeout` (all nodes are this machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def start_fleet(name: str, cleanup: list[Callable[[], Any]]) -> Any:
    from weightsync_ray.roster import start_fleet, stop_fleet
    handle = start_fleet(name, "weightsync-tests", lease=3, timeout=180)
    cleanup.append(lambda: stop_fleet(name, "weightsync-tests"))
    return handle


@pytest.mark.parametrize("transport", ["collective", "http"])
def test_two_rank_trainer_three_engine_actors_one_killed_and_back(
        transport: str, cluster: dict[str, str], cleanup: list, tmp_path: Path) -> None:
    import ray

    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch
    from weightsync_ray.trainer import RayTrainer

    model = write_initial_checkpoint(tmp_path / "model")
    fleet_name = f"multi-{transport}"
    fleet = start_fleet(fleet_name, cleanup)
    engines = [start_engine(f"e{i}", EngineLaunch(model=str(model)),
                            fleet=(fleet_name, "weightsync-tests"), resources={"engine": 1},
                            log_dir=str(tmp_path)) for i in range(3)]
    cleanup.append(lambda: stop_actors(engines))
    config = {"fleet": {"kind": "ray", "options": {"name": fleet_name,
                                                   "namespace": "weightsync-tests"}},
              "transport": transport, "exporter": EXPORTER, "sync": SYNC}
    trainer = RayTrainer(2, config, resources={"trainer": 1}, **POLICY)
    cleanup.append(trainer.shutdown)
    trainer.start()
    infos = wait_ready(engines, timeout=180)

    # placement is Ray's, forced by resources: ranks on the head, engines 2 + 1 on the others
    assert {i["node_ip"] for i in trainer.info} == {trainer.master["address"]}
    assert trainer.master["node_id"] == cluster["head"]
    assert collections.Counter(i["node_id"] for i in infos) == {cluster["a"]: 2, cluster["b"]: 1}
    if transport == "collective":      # the group meets at rank 0's node, as Ray knows it
        opts = trainer.info[0]["transport"]["options"]
        assert opts == {"master_address": trainer.master["address"], "master_port": 0}

    victim, node = engines[1], infos[1]["node_id"]
    reports = {}
    for v in range(1, 7):
        reports[v] = trainer.train_and_push(v)
        if v != 4:
            assert reports[v].ok and sorted(reports[v].engines) == ["e0", "e1", "e2"], \
                reports[v].summary()
            assert all(o.status == "verified" for o in reports[v].engines.values())
        if v == 3:
            ray.kill(victim, no_restart=False)     # Ray restarts it (max_restarts)
            assert process_gone(infos[1]["engine_pid"])    # its engine died with it
        if v == 4:
            # pushed while e1 was down or coming back: the others took it
            assert all(reports[4].engines[n].ok for n in ("e0", "e2")), reports[4].summary()
            back = wait_ready([victim], timeout=180)[0]     # registered, caught up, live
            assert back["restarted"] and back["node_id"] == node and back["version"] == 4
            assert back["url"] != infos[1]["url"]           # a new engine process
            e1 = next(m for m in ray.get(fleet.view.remote())["members"] if m["name"] == "e1")
            assert e1["state"] == "live" and e1["version"] == 4
            assert e1["pulled_from_peer"] >= 1 or reports[4].engines.get("e1", None) is not None \
                and reports[4].engines["e1"].ok

    weights = trainer.weights()
    for info in wait_ready(engines, timeout=60):
        assert info["version"] == 6
        assert mismatches(info["url"], weights) == []
    view = ray.get(fleet.view.remote())
    assert view["version"] == 6 and [m["version"] for m in view["members"]] == [6, 6, 6]


def test_the_clusters_workers_run_at_the_trainers_priority(cluster: dict[str, str]) -> None:
    """Ray would start its workers 15 nice levels below the process that started the cluster;
    `local_cluster` keeps them at its level on every node. (At +15, behind any busy process, a
    new fleet actor took 50-110 s to import weightsync instead of 2 s.)"""
    import os

    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    for node in ("head", "a", "b"):
        resource = {"head": "trainer", "a": "node_a", "b": "node_b"}[node]
        got = ray.get(niceness.options(resources={resource: 0.01}).remote(), timeout=180)
        assert got == os.nice(0), (node, got)
