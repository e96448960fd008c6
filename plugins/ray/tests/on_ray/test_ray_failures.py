"""Bad input on Ray (issue 16, item 7): a fleet actor that is gone, an engine actor whose process
fails to start, a trainer rank that dies in the middle of a push. Each is a clear error within
the push's deadline, and every engine is left at a whole version (bit-exact with what it held)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
from weightsync_ray.testing import (
    POLICY,
    build_policy,
    mismatches,
    train_step,
    write_initial_checkpoint,
)
from weightsync.testing.waiting import wait_for

pytestmark = pytest.mark.slow
NS = "weightsync-tests"
DEADLINE = 30.0
EXPORTER = {"kind": "torch", "options": {"bucket_bytes": 16384}}


def start_fleet(name: str, cleanup: list[Callable[[], Any]]) -> Any:
    from weightsync_ray.roster import start_fleet, stop_fleet
    handle = start_fleet(name, NS, lease=3, timeout=180)
    cleanup.append(lambda: stop_fleet(name, NS))
    return handle


def test_a_fleet_actor_that_is_gone(cluster: dict[str, str], cleanup: list, tmp_path: Path) -> None:
    """The push that finds the fleet actor gone fails at once, naming it, and contacts no
    engine; the trainer starts a new fleet actor, the engine actors register with it again, and
    the next push reaches them."""
    import ray
    from weightsync import WeightSync
    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.fleet import FleetError
    from weightsync_ray.roster import find_fleet, stop_fleet
    from weightsync_ray.launch import EngineLaunch

    model = write_initial_checkpoint(tmp_path / "model")
    start_fleet("gone", cleanup)
    engines = [start_engine(f"g{i}", EngineLaunch(model=str(model)), fleet=("gone", NS),
                            resources={"engine": 1}, log_dir=str(tmp_path)) for i in range(2)]
    cleanup.append(lambda: stop_actors(engines))
    infos = wait_ready(engines, timeout=180)
    sync = WeightSync.from_config({
        "fleet": {"kind": "ray", "options": {"name": "gone", "namespace": NS, "lease": 3}},
        "exporter": EXPORTER, "sync": {"progress": "off", "lease": 3, "deadline": DEADLINE}})
    cleanup.append(sync.close)
    policy, state = build_policy(), {}
    train_step(policy, 1, state)
    assert sync.push(policy, version=1).ok
    v1 = {k: v.detach().clone() for k, v in policy.state_dict().items()}

    assert stop_fleet("gone", NS)                        # killed for good: Ray does not restart it
    train_step(policy, 2, state)
    t0 = time.monotonic()
    with pytest.raises(FleetError) as err:
        sync.push(policy, version=2)
    assert time.monotonic() - t0 < DEADLINE
    text = str(err.value)
    assert "fleet actor 'gone' (Ray namespace 'weightsync-tests') is gone" in text
    assert "no engine was contacted" in text and "a new fleet actor was started" in text
    for handle, info in zip(engines, infos, strict=True):    # untouched: version 1, bit for bit
        assert ray.get(handle.info.remote())["version"] == 1
        assert mismatches(info["url"], v1) == []

    wait_ready(engines, timeout=60)                      # they registered with the new actor
    report = sync.push(policy, version=3)
    assert report.ok and sorted(report.engines) == ["g0", "g1"]
    v3 = {k: v.detach() for k, v in policy.state_dict().items()}
    for info in infos:
        assert mismatches(info["url"], v3) == []

    # the fleet actor's process dies: Ray restarts it (empty: its state is leases) and the
    # engine actors register with it again at their next renewal
    ray.kill(find_fleet("gone", NS), no_restart=False)

    def both_live_again() -> bool:                       # the restarted actor's own view
        try:
            view = ray.get(find_fleet("gone", NS).view.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - still restarting: ask again
            return False
        return sorted(m["name"] for m in view["members"] if m["state"] == "live") == ["g0", "g1"]
    wait_for(both_live_again, timeout=60, what="g0 and g1 live in the restarted fleet actor")
    wait_ready(engines, timeout=60)
    train_step(policy, 4, state)
    report = sync.push(policy, version=4)
    assert report.ok and sorted(report.engines) == ["g0", "g1"]


def test_a_fleet_that_must_exist_and_does_not(cluster: dict[str, str]) -> None:
    from weightsync import WeightSync
    from weightsync_ray.runtime import ActorGone
    with pytest.raises(ActorGone, match="there is no fleet actor 'nobody' in Ray namespace"):
        WeightSync.from_config({"fleet": {"kind": "ray", "options": {
            "name": "nobody", "namespace": NS, "create": False}}})


@pytest.mark.parametrize("case", ["exits", "never_healthy"])
def test_an_engine_whose_process_fails_to_start(case: str, cluster: dict[str, str], cleanup: list,
                                                 tmp_path: Path) -> None:
    """The actor is not restarted into the same failure: it dies with the reason, which
    `wait_ready` raises (the engine's command and the last lines of its output)."""
    from weightsync_ray.engine import EngineStartError, start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch

    if case == "exits":
        launch = EngineLaunch(model=str(tmp_path / "no-such-model"))
        expected = (r"engine bad on node \S+ exited with code 2 while starting(.|\n)*"
                    r"model directory \S+no-such-model does not exist")
    else:
        launch = EngineLaunch(model=str(tmp_path), command=["sleep", "600"], start_timeout=3)
        expected = r"engine bad on node \S+ did not answer its health check within 3s"
    start_fleet("bad", cleanup)
    engine = start_engine("bad", launch, fleet=("bad", NS), log_dir=str(tmp_path))
    cleanup.append(lambda: stop_actors([engine]))
    with pytest.raises(EngineStartError, match=expected) as err:
        wait_ready([engine], timeout=120)
    assert "its constructor raised EngineStartError" in str(err.value)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_trainer_rank_that_dies_mid_push(rank: int, cluster: dict[str, str], cleanup: list,
                                           tmp_path: Path) -> None:
    """A rank's process exits in the middle of the exporter's gather, after the engines opened
    their round. The push fails within its deadline, naming the dead rank; every engine stays at
    version 1, bit for bit (rank 0 aborts the round, or, when rank 0 died, the round's lease
    lapses), and the broken trainer refuses further pushes."""
    import ray
    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch
    from weightsync_ray.testing import DieOnSend
    from weightsync_ray.trainer import RayTrainer, TrainerError

    model = write_initial_checkpoint(tmp_path / "model")
    fleet_name = f"dies-{rank}"
    start_fleet(fleet_name, cleanup)
    engines = [start_engine(f"d{i}", EngineLaunch(model=str(model)), fleet=(fleet_name, NS),
                            resources={"engine": 1}, log_dir=str(tmp_path)) for i in range(2)]
    cleanup.append(lambda: stop_actors(engines))
    config = {"fleet": {"kind": "ray", "options": {"name": fleet_name, "namespace": NS}},
              "transport": "http", "exporter": EXPORTER,
              "sync": {"progress": "off", "lease": 3, "deadline": DEADLINE}}
    trainer = RayTrainer(2, config, resources={"trainer": 1}, **POLICY)
    cleanup.append(trainer.shutdown)
    trainer.start()
    infos = wait_ready(engines, timeout=180)
    assert trainer.train_and_push(1).ok
    v1 = trainer.weights()

    t0 = time.monotonic()
    with pytest.raises(TrainerError) as err:
        trainer.train_and_push(2, before=DieOnSend(rank, after=2))
    assert time.monotonic() - t0 < DEADLINE
    text = str(err.value)
    assert f"trainer rank(s) [{rank}] died while training and pushing version 2" in text
    assert "Restart the trainer" in text and f"rank {1 - rank}: " in text

    def settled(info: dict[str, Any]) -> bool:        # no round open any more
        import requests
        return requests.get(info["url"] + "/health", timeout=10).json()["round"] is None
    deadline = time.monotonic() + DEADLINE
    while not all(settled(i) for i in infos):
        assert time.monotonic() < deadline, "a round stayed open past its lease"
        time.sleep(0.2)
    for handle, info in zip(engines, infos, strict=True):
        assert ray.get(handle.info.remote())["version"] == 1
        assert mismatches(info["url"], v1) == []
    with pytest.raises(TrainerError, match="the trainer cannot push: rank"):
        trainer.train_and_push(3)


def test_an_engine_process_that_dies_takes_its_actor_with_it(cluster: dict[str, str],
                                                             cleanup: list, tmp_path: Path) -> None:
    """The engine's process crashes (SIGKILL) while its actor lives: the actor exits as a crash,
    Ray restarts it, and the new engine registers under the same name at its new address."""
    import ray
    from weightsync_ray.engine import start_engine, stop_actors, wait_ready
    from weightsync_ray.launch import EngineLaunch

    model = write_initial_checkpoint(tmp_path / "model")
    fleet = start_fleet("crash", cleanup)
    # pinned to node b: Ray restarts the actor there (with only `resources`, any node that has
    # them may take the restarted actor)
    engine = start_engine("c0", EngineLaunch(model=str(model)), fleet=("crash", NS),
                          node_id=cluster["b"], log_dir=str(tmp_path))
    cleanup.append(lambda: stop_actors([engine]))
    before = wait_ready([engine], timeout=180)[0]
    try:
        ray.get(engine.kill_engine.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        pass                                   # the actor may exit before it answers
    deadline = time.monotonic() + 180
    while True:                                # until Ray has restarted the actor
        try:
            if ray.get(engine.info.remote(), timeout=30)["restarted"]:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.2)
    after = wait_ready([engine], timeout=180)[0]
    assert after["restarted"] and after["actor_pid"] != before["actor_pid"]
    assert after["url"] != before["url"] and after["node_id"] == before["node_id"]
    members = ray.get(fleet.view.remote())["members"]
    assert [(m["name"], m["url"], m["state"]) for m in members] == [("c0", after["url"], "live")]
