"""verl checkpoint-engine backend `weightsync` (verl 0.9.1's CheckpointEngine contract).

Select it with
    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl
and options under `checkpoint_engine.engine_kwargs.weightsync` (see `WeightSyncCheckpointEngine`).

Per round verl calls `prepare` on every worker, `build_topology` once, `init_process_group` on
every worker, then `send_weights` on the actor ranks and `receive_weights` on every rollout
worker at the same time, and `finalize`. Here the actor's rank 0 publishes the round (one hashed
manifest, one frame per bucket) and waits until every replica that is live in its fleet registry
holds it; each rollout worker registers itself on its first round, then pulls and verifies.
Replicas added or removed between rounds need nothing else: a new one registers and pulls the
current version (it catches up whatever it missed), one that goes away deregisters or lapses and
is no longer waited for."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .publisher import Publisher, RoundResult
from .subscriber import Subscriber, replica_name

log = logging.getLogger("weightsync.verl")


@CheckpointEngineRegistry.register("weightsync")
class WeightSyncCheckpointEngine(CheckpointEngine):
    """Options (`engine_kwargs.weightsync`): `host` / `port` / `advertise` where rank 0 serves
    (default 127.0.0.1, any free port; set `host: 0.0.0.0` and `advertise: <routable ip>` across
    nodes), `lease` (seconds a replica stays without a heartbeat, 10), `deadline` (seconds a round
    waits for its replicas, 600), `dtype` (cast floating tensors to it for the rollout, e.g.
    "bfloat16"; default: as sent)."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 256 * 2**20, is_master: bool = False, *,
                 host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 lease: float = 10.0, deadline: float = 600.0, dtype: str | None = None,
                 **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"weightsync checkpoint engine: unknown option(s) {sorted(unknown)}; "
                            f"known: host, port, advertise, lease, deadline, dtype")
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.lease, self.deadline = float(lease), float(deadline)
        self.dtype = getattr(torch, dtype) if dtype else None
        self.rank: int | None = None
        self.expected: int | None = None
        self.publisher: Publisher | None = None
        self.subscriber: Subscriber | None = None
        self.master: dict[str, Any] | None = None
        self.last: RoundResult | None = None
        if self.is_master:
            self.publisher = Publisher(host=host, port=port, advertise=advertise,
                                       bucket_bytes=self.bucket_size, lease=self.lease)

    # -- topology -----------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any] | None:
        """Rank 0: where replicas reach it and the version published before this round."""
        if self.publisher is None:
            return None
        return {**self.publisher.metadata(), "published": self.publisher.version}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = next((m for m in metadata if isinstance(m, dict) and m.get("url")), None)
        if master is None:
            raise RuntimeError("no actor worker of the weightsync checkpoint engine is the "
                               "master (is_master=True on the actor's rank 0)")
        trainer: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (trainer_world_size - 1),
            "world_size": [rollout_world_size + 1] * trainer_world_size,
            "master_metadata": [master] * trainer_world_size}
        rollout: dict[str, list[Any]] = {
            "rank": list(range(1, rollout_world_size + 1)),
            "world_size": [rollout_world_size + 1] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size}
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """Rollout workers register with the trainer's registry (once; the membership then
        heartbeats on its own). The actor's rank 0 learns how many replicas this round has."""
        self.rank = int(rank)
        self.master = dict(master_metadata)
        if self.rank == 0:
            self.expected = int(world_size) - 1
        elif self.rank > 0:
            same = self.subscriber is not None and self.subscriber.master["url"] == self.master["url"]
            if not same:
                if self.subscriber is not None:
                    self.subscriber.leave()
                self.subscriber = Subscriber(self.master, replica_name(self.rank))

    def finalize(self) -> None:
        """Nothing to free between rounds: the published version stays served for replicas that
        join later, and memberships stay."""

    def leave(self) -> None:
        """A replica going away for good: deregister so that no round waits for it."""
        if self.subscriber is not None:
            self.subscriber.leave()
            self.subscriber = None

    def close(self) -> None:
        self.leave()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    # -- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 publishes the round as version `global_steps` (or the next one) and returns
        verl's per-sync metric dict; other actor ranks only run the generator (gathers are
        collectives)."""
        if self.rank is None:
            raise RuntimeError("send_weights before init_process_group: verl's checkpoint "
                               "engine manager builds the topology first")
        named: dict[str, torch.Tensor] = {}
        async for name, t in _aiter(weights):
            if self.publisher is not None:
                t = t.detach()
                if self.dtype is not None and t.is_floating_point():
                    t = t.to(self.dtype)
                named[name] = t.to("cpu", copy=True)
        if self.publisher is None or self.rank != 0:
            return {}
        if not named:
            raise ValueError("send_weights got no tensors from the actor's weights generator")
        t0 = time.monotonic()
        asked = int(global_steps) if global_steps is not None else None
        if asked is not None and asked <= self.publisher.version:
            log.warning("weightsync: global step %d is not newer than the published version %d; "
                        "publishing %d", asked, self.publisher.version, self.publisher.version + 1)
            asked = None
        version = await asyncio.to_thread(self.publisher.publish, named, asked)
        t1 = time.monotonic()
        reached, left, missing = await asyncio.to_thread(self.publisher.wait, version,
                                                         self.deadline, self.expected)
        plan = self.publisher.shares.manifest(version, self.publisher.store)
        failed = dict(self.publisher.failures.pop(version, {}))
        self.last = RoundResult(version, len(named), sum(b["nbytes"] for b in plan["buckets"]),
                                len(plan["buckets"]), reached, left, missing, failed,
                                round(t1 - t0, 4), round(time.monotonic() - t1, 4))
        for name, why in failed.items():
            log.warning("weightsync round v%d: replica %s failed: %s", version, name, why)
        if missing:
            log.warning("weightsync round v%d: %s did not take it within %.0fs", version,
                        ", ".join(missing), self.deadline)
        if left:
            log.info("weightsync round v%d: %s left", version, ", ".join(left))
        return self.last.metrics()

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """This round's version, bucket by bucket: each bucket's digest checked against the
        trainer's manifest before any of its tensors is yielded."""
        sub = self._subscriber()
        after = int((self.master or {}).get("published", 0))
        target = max(after + 1, int(global_steps) if global_steps is not None else 0)
        got = await asyncio.to_thread(sub.wait_for, target - 1, self.deadline)
        if got < target:
            raise TimeoutError(f"the trainer published no version >= {target} within "
                               f"{self.deadline:g}s (it serves {got})")
        async for item in _pulled(sub):
            yield item

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The version the trainer serves now, verified (a replica that restarted)."""
        async for item in _pulled(self._subscriber()):
            yield item

    def _subscriber(self) -> Subscriber:
        if self.subscriber is None:
            raise RuntimeError("receive_weights before init_process_group (or on an actor rank): "
                               "a rollout worker registers in init_process_group")
        return self.subscriber


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def _pulled(sub: Subscriber) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Run the blocking pull on a thread, bucket by bucket, without blocking verl's loop."""
    it = sub.pull()
    done = object()
    while True:
        item = await asyncio.to_thread(next, it, done)
        if item is done:
            return
        yield cast("tuple[str, torch.Tensor]", item)     # anything but `done` is a pulled one
