"""verl 0.9.1's checkpoint-engine contract driven as verl's CheckpointEngineManager drives it
(prepare on every worker, build_topology, init_process_group, send_weights and receive_weights
at once, finalize), with the backend created the way verl creates it (custom_backend_module, then
CheckpointEngineRegistry.new), and the actor and every rollout replica in processes of their own.
After each round every replica holds the actor's tensors bit for bit; a replica started late
catches up; one killed or leaving does not block the next round."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

verl_ce = pytest.importorskip("verl.checkpoint_engine",
                              reason="verl is not installed here: `make test-verl` sets up its venv")
CheckpointEngineRegistry = verl_ce.CheckpointEngineRegistry
WORKER = Path(__file__).with_name("verl_worker.py")
sys.path.insert(0, str(WORKER.parent))
from verl_worker import BUCKET, engine, fingerprint, weights  # noqa: E402


class Worker:
    """A verl worker in a process of its own, driven over JSON lines (stdin/stdout)."""

    def __init__(self, role: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), role], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pending = 0
        assert self.result(300) == "ready"

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.send(cmd, arg)
        return self.result()

    def send(self, cmd: str, arg: Any = None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "arg": arg}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 180.0) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"worker {self.proc.pid} gave no answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker {self.proc.pid} exited ({self.proc.poll()})")
        msg = json.loads(line)
        if "error" in msg:
            raise AssertionError(msg["error"])
        return msg["ok"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
                self.proc.wait(10)
            except Exception:  # noqa: BLE001 - it may be dead already
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def run_round(actor: Worker, replicas: list[Worker], step: int) -> tuple[dict, list[dict]]:
    """One update_weights round, in the order verl's CheckpointEngineManager makes it."""
    workers = [actor, *replicas]
    metadata = [w.call("prepare") for w in workers]
    cls = CheckpointEngineRegistry.get("weightsync")
    actor_kw, rollout_kw = cls.build_topology(1, len(replicas), metadata)
    for i, w in enumerate(workers):
        kw = actor_kw if i == 0 else rollout_kw
        j = 0 if i == 0 else i - 1
        w.send("init", {k: v[j] for k, v in kw.items()})
    for w in workers:
        w.result()
    actor.send("send", step)
    for r in replicas:
        r.send("receive", step)
    got = [r.result() for r in replicas]
    metrics = actor.result()
    for w in workers:
        w.call("finalize")
    return metrics, got


def test_rounds_with_a_late_joiner_a_dead_replica_and_a_leaver() -> None:
    actor = Worker("master")
    r1, r2 = Worker("replica"), Worker("replica")
    late: Worker | None = None
    try:
        m, got = run_round(actor, [r1, r2], 1)
        want = fingerprint(weights(1).items())
        assert got == [want, want]
        assert m["weightsync/version"] == 1 and m["weightsync/replicas_ok"] == 2
        assert m["weightsync/bytes"] == sum(t.numel() * t.element_size() for t in weights(1).values())

        late = Worker("replica")                     # joins at step 2, missed step 1
        m, got = run_round(actor, [r1, r2, late], 2)
        want = fingerprint(weights(2).items())
        assert got == [want, want, want]
        assert m["weightsync/replicas_ok"] == 3 and m["weightsync/version"] == 2

        os.kill(r2.proc.pid, signal.SIGKILL)         # dies without deregistering
        r2.proc.wait(10)
        m, got = run_round(actor, [r1, late], 3)     # verl's remove_replicas: not in the round
        want = fingerprint(weights(3).items())
        assert got == [want, want]
        assert m["weightsync/replicas_ok"] == 2
        assert m["weightsync/replicas_left"] == 1 and m["weightsync/replicas_missing"] == 0

        r1.call("leave")                             # leaves for good: deregisters
        m, got = run_round(actor, [late], 4)
        assert got == [fingerprint(weights(4).items())]
        assert m["weightsync/replicas_ok"] == 1 and m["weightsync/replicas_missing"] == 0
    finally:
        for w in (r1, r2, late, actor):
            if w is not None:
                w.stop()


def test_other_actor_ranks_only_run_the_generator() -> None:
    """Actor ranks other than 0 (rank -1 in the topology) consume the weights (their gathers
    are collectives) and send nothing."""
    import asyncio
    engine_ = engine(False)
    engine_.init_process_group(rank=-1, world_size=3, master_metadata={"url": "http://127.0.0.1:1"})
    seen: list[str] = []

    def gen() -> Any:
        for n, t in weights(1).items():
            seen.append(n)
            yield n, t
    assert asyncio.run(engine_.send_weights(gen(), global_steps=1)) == {}
    assert seen == list(weights(1))


def test_unknown_option_is_refused() -> None:
    from verl.utils.import_utils import import_external_libs
    import_external_libs("weightsync_verl")
    with pytest.raises(TypeError, match="unknown option.*colour"):
        CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, colour="red")
    with pytest.raises(ValueError, match="not a torch dtype"):
        CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, dtype="bfloat17")


def test_dtype_option_casts_floating_tensors_for_the_rollout() -> None:
    """`engine_kwargs.weightsync.dtype: bfloat16`: floating tensors reach the replica cast (as
    verl's NCCL engine casts to its rollout dtype), integer tensors as they were."""
    import asyncio
    import threading
    from verl.utils.import_utils import import_external_libs
    import_external_libs("weightsync_verl")
    master = CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, is_master=True,
                                          dtype="bfloat16", lease=5.0, deadline=60.0)
    replica = CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, lease=5.0, deadline=60.0)
    try:
        meta = [master.prepare(), replica.prepare()]
        actor_kw, rollout_kw = type(master).build_topology(1, 1, meta)
        master.init_process_group(**{k: v[0] for k, v in actor_kw.items()})
        replica.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})
        got: dict[str, torch.Tensor] = {}

        async def take() -> None:
            async for n, t in replica.receive_weights(global_steps=3):
                got[n] = t.clone()
        t = threading.Thread(target=lambda: asyncio.run(take()))
        t.start()
        metrics = asyncio.run(master.send_weights(iter(weights(3).items()), global_steps=3))
        t.join(60)
        assert metrics["weightsync/version"] == 3 and metrics["weightsync/replicas_ok"] == 1
        for n, w in weights(3).items():
            want = w.to(torch.bfloat16) if w.is_floating_point() else w
            assert got[n].dtype == want.dtype and torch.equal(got[n], want), n
    finally:
        replica.close()
        master.close()
