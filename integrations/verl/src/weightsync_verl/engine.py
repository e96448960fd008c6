"""verl checkpoint-engine backend `weightsync` (verl 0.9.1's CheckpointEngine contract).

Select it with
    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl
and options under `checkpoint_engine.engine_kwargs.weightsync` (see `WeightSyncCheckpointEngine`).

Per round verl's CheckpointEngineManager calls `prepare` on every worker, `build_topology` once,
`init_process_group` on every worker, then `send_weights` on the actor ranks and
`receive_weights` on every rollout worker at the same time, and `finalize`. The actor's rank 0
pushes with `WeightSync` (weightsync's transports, encodings, digests before commit, round
report) into an engine each rollout worker runs and registers with rank 0's fleet registry; the
push reaches exactly the workers of verl's topology that are live members."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import requests
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from weightsync import SyncReport

from .replica import Replica
from .trainer import TOKEN_HEADER, Trainer

log = logging.getLogger("weightsync.verl")
_ids = itertools.count()


def _member_name() -> str:
    """Stable for the worker's life (verl's ranks move as replicas come and go)."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-{os.getpid()}-{next(_ids)}"


@CheckpointEngineRegistry.register("weightsync")
class WeightSyncCheckpointEngine(CheckpointEngine):
    """Options (`engine_kwargs.weightsync`): `host` / `port` / `advertise` where rank 0's registry
    and each replica's engine listen (default 127.0.0.1, free ports; `host: 0.0.0.0` and
    `advertise: <routable ip>` across nodes), `lease` (seconds a replica stays registered without
    a heartbeat, 10), `deadline` (seconds a round may take, 600), `config` (weightsync's config
    for the push: `transport`, `encoding`, `sync`; e.g. `{transport: {kind: http, options:
    {relay: tree}}}`)."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 256 * 2**20, is_master: bool = False, *,
                 host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 lease: float = 10.0, deadline: float = 600.0,
                 config: dict[str, Any] | None = None, **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"weightsync checkpoint engine: unknown option(s) {sorted(unknown)}; "
                            f"known: host, port, advertise, lease, deadline, config")
        self.bucket_size, self.is_master = int(bucket_size), bool(is_master)
        self.host, self.advertise = host, advertise
        self.lease, self.deadline = float(lease), float(deadline)
        self.name = _member_name()
        self.rank: int | None = None
        self.trainer: Trainer | None = None
        self.replica: Replica | None = None
        self.master: dict[str, Any] = {}
        self.topology: list[str] = []
        self.starting: list[str] = []
        if self.is_master:
            self.trainer = Trainer(host=host, port=port, advertise=advertise, lease=self.lease,
                                   deadline=self.deadline, bucket_bytes=self.bucket_size,
                                   config=dict(config or {}))

    # -- topology -----------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Rank 0: where replicas reach it, the layout and version so far. A rollout worker:
        its member name, and whether its engine runs (registered) already."""
        if self.trainer is not None:
            return {"master": self.trainer.metadata()}
        return {"member": self.name, "ready": self.replica is not None}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = next((m["master"] for m in metadata if isinstance(m, dict) and m.get("master")),
                      None)
        if master is None:
            raise RuntimeError("no actor worker of the weightsync checkpoint engine is the "
                               "master (is_master=True on the actor's rank 0)")
        rollout_meta = metadata[trainer_world_size:]
        names = [m["member"] for m in rollout_meta]
        starting = [m["member"] for m in rollout_meta if not m["ready"]]
        trainer: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (trainer_world_size - 1),
            "world_size": [rollout_world_size + 1] * trainer_world_size,
            "master_metadata": [{**master, "topology": names, "starting": starting}]
            + [master] * (trainer_world_size - 1)}
        rollout: dict[str, list[Any]] = {
            "rank": list(range(1, rollout_world_size + 1)),
            "world_size": [rollout_world_size + 1] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size}
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """Rank 0 learns this round's topology. A rollout worker starts its engine and registers
        (once; the membership then heartbeats on its own) when the trainer's layout is known;
        in the first round it is not, and `receive_weights` starts it."""
        self.rank, self.master = int(rank), dict(master_metadata)
        if self.rank == 0:
            self.topology = list(self.master.get("topology", []))
            self.starting = list(self.master.get("starting", []))
        elif self.rank > 0:
            if self.replica is not None and self.replica.master["registry"] != self.master["registry"]:
                self.replica.close()                  # a new trainer: register there instead
                self.replica = None
            if self.replica is None and self.master.get("layout"):
                self._start(self.master["layout"])

    def _start(self, layout: list[list[Any]]) -> Replica:
        self.replica = Replica(self.master, layout, self.name, host=self.host,
                               advertise=self.advertise)
        return self.replica

    def finalize(self) -> None:
        """Nothing to free between rounds: engines and memberships stay."""

    def leave(self) -> None:
        """A replica going away for good: deregister, so that no push reaches it."""
        if self.replica is not None:
            self.replica.leave()

    def report(self) -> dict[str, Any] | None:
        """Rank 0: the last round's report (weightsync's JSON, docs/report.md)."""
        last = self.trainer.last if self.trainer is not None else None
        return None if last is None else last.to_json()

    def version(self) -> int:
        """A rollout worker: the version its engine holds (0: none yet)."""
        return 0 if self.replica is None else self.replica.version

    def close(self) -> None:
        if self.replica is not None:
            self.replica.close()
            self.replica = None
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    # -- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 pushes the round as version `global_steps` (or the next one) and returns verl's
        per-sync metric dict; other actor ranks only run the generator (its gathers are
        collectives)."""
        if self.rank is None:
            raise RuntimeError("send_weights before init_process_group: verl's checkpoint "
                               "engine manager builds the topology first")
        named: dict[str, torch.Tensor] = {}
        async for name, t in _aiter(weights):
            if self.trainer is not None:
                named[name] = t.detach().to("cpu", copy=True)
        if self.trainer is None or self.rank != 0:
            return {}
        if not named:
            raise ValueError("send_weights got no tensors from the actor's weights generator")
        last = self.trainer.sync.last_version or 0
        version = int(global_steps) if global_steps is not None else last + 1
        if version <= last:
            log.warning("weightsync: global step %d is not newer than the pushed version %d; "
                        "pushing %d", version, last, last + 1)
            version = last + 1
        report = await asyncio.to_thread(self.trainer.push, named, version, self.topology,
                                         self.starting, self.deadline)
        for line in report.summary().splitlines()[1:]:
            log.warning("weightsync round v%d: %s", version, line.strip())
        return metrics(report, self.topology, self.trainer.fleet.absent)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """This round's version, once this worker's engine committed it (every bucket's digest
        checked before the commit): the whole model, in the trainer's order."""
        replica = self.replica
        if replica is None:
            replica = await asyncio.to_thread(self._start_from_trainer)
        target = max(int(self.master.get("version", 0)) + 1,
                     int(global_steps) if global_steps is not None else 0)
        await asyncio.to_thread(replica.wait, target, self.deadline)
        for item in replica.weights():
            yield item

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The version this worker's engine holds now (a server adapter that restarted)."""
        if self.replica is None or self.replica.version == 0:
            raise RuntimeError("this rollout worker holds no version yet")
        for item in self.replica.weights():
            yield item

    def _start_from_trainer(self) -> Replica:
        """The first round: the layout from rank 0 (a long poll; it arrives when the actor's
        tensors do), then the engine, then registration."""
        if self.rank is None or self.rank <= 0 or not self.master.get("url"):
            raise RuntimeError("receive_weights before init_process_group (or on an actor "
                               "rank): a rollout worker joins in init_process_group")
        r = requests.get(self.master["url"] + "/weightsync/verl/layout",
                         params={"timeout": min(self.deadline, 300.0)},
                         headers={TOKEN_HEADER: self.master["token"]},
                         timeout=min(self.deadline, 300.0) + 30)
        if r.status_code != 200 or not r.json().get("layout"):
            raise RuntimeError(f"the trainer at {self.master['url']} gave no layout "
                               f"(HTTP {r.status_code}): {r.text[:300]}")
        return self._start(r.json()["layout"])


def metrics(report: SyncReport, topology: list[str], absent: list[str],
            prefix: str = "weightsync/") -> dict[str, float]:
    """verl's per-step metric dict from weightsync's round report."""
    ok = [o for o in report.engines.values() if o.ok]
    return {f"{prefix}version": float(report.version),
            f"{prefix}bytes": float(report.logical_bytes),
            f"{prefix}wire_bytes": float(report.wire_bytes),
            f"{prefix}seconds": float(report.seconds.get("total", 0.0)),
            f"{prefix}pause_s": float(report.pause_window),
            f"{prefix}replicas_topology": float(len(topology)),
            f"{prefix}replicas_ok": float(len(ok)),
            f"{prefix}replicas_verified": float(sum(o.status == "verified" for o in ok)),
            f"{prefix}replicas_failed": float(len(report.failed)),
            f"{prefix}replicas_absent": float(len(absent)),
            f"{prefix}replicas_caught_up": float(sum(o.caught_up for o in ok)),
            f"{prefix}probed": 0.0}


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield cast("tuple[str, torch.Tensor]", item)
    else:
        for item in weights:
            yield item
