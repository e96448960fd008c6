"""A trainer whose ranks are Ray actors: one rank per actor, torch.distributed over gloo (CPU) or
nccl (GPU), the model sharded with FSDP2, and a WeightSync on every rank. Every rank calls `push`
and rank 0 sends (the others take part in gathering the shards). The addresses come from Ray:
the default process group and the collective transport's group both rendezvous at rank 0's node
address, on ports that rank 0 found free on its node, so nothing in the config names a host.

    trainer = RayTrainer(2, config, model="my_pkg.model:build", step="my_pkg.model:train_step",
                         resources={"trainer": 1}).start()
    for v in range(1, steps + 1):
        report = trainer.train_and_push(v)
    trainer.shutdown()

verl, slime and OpenRLHF already have their own rank actors: they call `rendezvous` on rank 0 for
the addresses and `ray_collective(config, ...)` before `WeightSync.from_config` (docs/ray.md)."""

from __future__ import annotations

import datetime
import importlib
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import ray
import torch

from weightsync.errors import SyncError, WeightSyncError
from weightsync import SyncReport
from weightsync.net.server import free_port
from weightsync_ray.runtime import ActorGone, get, node_ip, reason, short
from weightsync_ray.engine import placement

log = logging.getLogger("weightsync_ray")


class TrainerError(WeightSyncError):
    """A trainer rank died or failed; the message says which, and what rank 0 saw."""

    def __init__(self, message: str, report: SyncReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class RankFailed(WeightSyncError):
    """What failed on one rank, with the exceptions that led to it (their chain does not survive
    the trip to the driver otherwise)."""


def chain(e: BaseException) -> str:
    """"first error; then the next; ...": an error raised while handling another names both."""
    seen: list[BaseException] = []
    while e is not None and e not in seen and len(seen) < 5:
        seen.append(e)
        e = e.__cause__ or e.__context__     # type: ignore[assignment]
    return "; then ".join(f"{type(x).__name__}: {short(str(x))}" for x in reversed(seen))


def load(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A function given as "module:function" (what travels to the actors), or itself."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{ref!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), attr)


def rendezvous() -> dict[str, Any]:
    """On rank 0's actor: its node's address as Ray knows it and a port free there, where the
    trainer's default process group meets."""
    return {"address": node_ip(), "port": free_port(),
            "node_id": ray.get_runtime_context().get_node_id()}


def ray_collective(config: Mapping[str, Any], address: str) -> dict[str, Any]:
    """`config` with the collective transport's master address taken from Ray (rank 0's node)
    and its port left to rank 0's node (0: a port free there when each group is built), unless
    the config sets them itself. A fixed port would not do: the transport builds a new group
    whenever the fleet changes, while the previous group's store may still hold the port."""
    out = dict(config)
    tr = out.get("transport") or {"kind": "http"}
    tr = {"kind": tr} if isinstance(tr, str) else dict(tr)
    if tr.get("kind") == "collective":
        options = dict(tr.get("options") or {})
        options.setdefault("master_address", address)
        options.setdefault("master_port", 0)
        tr["options"] = options
        out["transport"] = tr
    return out


def pick_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if ray.get_gpu_ids() and torch.cuda.is_available() else "gloo"


class TrainerWorker:
    """One rank (the actor's body; `TrainerActor` is this class under `ray.remote`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.rank, self.world_size = rank, world_size
        self.model: Any = None
        self.sync: Any = None
        self.state: dict[str, Any] = {}
        self.step_fn: Callable[..., Any] | None = None

    def rendezvous(self) -> dict[str, Any]:
        return rendezvous()

    def setup(self, master: Mapping[str, Any], config: Mapping[str, Any], model: str,
              step: str | None = None, shard: str | None = None, backend: str = "auto",
              timeout: float = 600.0, seed: int = 0) -> dict[str, Any]:
        """Join the trainer's process group, build and shard the model, build the WeightSync."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from weightsync.sync.pipeline import WeightSync
        backend = pick_backend(backend)
        device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(0)             # Ray shows each GPU actor its own device 0
        dist.init_process_group(backend, init_method=f"tcp://{master['address']}:{master['port']}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        torch.manual_seed(seed)
        self.model = load(model)().to(device)
        if self.world_size > 1:
            mesh = init_device_mesh(device, (self.world_size,))
            if shard is not None:
                load(shard)(self.model, mesh)
            else:
                from torch.distributed.fsdp import fully_shard
                fully_shard(self.model, mesh=mesh)
        self.step_fn = load(step) if step else None
        cfg = ray_collective(config, master["address"])
        self.sync = WeightSync.from_config(cfg)
        return {"rank": self.rank, "backend": backend, "node_ip": node_ip(),
                "transport": cfg.get("transport")}

    def train(self, version: int) -> None:
        if self.step_fn is None:
            raise WeightSyncError("this trainer has no `step` function: give step='module:fn'")
        self.step_fn(self.model, version, self.state)

    def push(self, version: int, before: Callable[[int], None] | None = None) -> dict[str, Any]:
        """`sync.push` on this rank; `before(rank)` runs first (tests inject faults with it)."""
        if before is not None:
            before(self.rank)
        try:
            return self.sync.push(self.model, version=version).to_json()
        except SyncError:
            raise
        except Exception as e:
            log.exception("rank %d: the push of version %d failed", self.rank, version)
            raise RankFailed(chain(e)) from None

    def train_and_push(self, version: int, before: Callable[[int], None] | None = None
                       ) -> dict[str, Any]:
        self.train(version)
        return self.push(version, before)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0 (sharded tensors gathered: every rank must call this)."""
        out = {}
        for name, t in self.model.state_dict().items():
            if type(t).__name__ == "DTensor":
                t = t.full_tensor()
            if self.rank == 0:
                out[name] = t.detach().cpu().clone()
        return out if self.rank == 0 else None

    def close(self) -> None:
        import torch.distributed as dist
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        if dist.is_initialized():
            dist.destroy_process_group()


TrainerActor = ray.remote(num_cpus=0, max_restarts=0)(TrainerWorker)


class RayTrainer:
    """N rank actors driven together (see the module docstring). A rank that dies breaks the
    process group, so the trainer is then refused further pushes: restart it (the engines and
    the fleet actor are untouched and keep their last whole version)."""

    def __init__(self, world_size: int, config: Mapping[str, Any], *, model: str,
                 step: str | None = None, shard: str | None = None, backend: str = "auto",
                 resources: Mapping[str, float] | None = None, num_gpus: float | None = None,
                 seed: int = 0, setup_timeout: float = 300.0) -> None:
        self.world_size, self.config = world_size, dict(config)
        self.model, self.step, self.shard, self.backend = model, step, shard, backend
        self.resources, self.num_gpus, self.seed = dict(resources or {}), num_gpus, seed
        self.setup_timeout = setup_timeout
        self.deadline = float((self.config.get("sync") or {}).get("deadline", 600.0))
        self.ranks: list[Any] = []
        self.broken: str | None = None
        self.master: dict[str, Any] = {}

    def start(self) -> "RayTrainer":
        opts: dict[str, Any] = placement(self.resources or None)
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        self.ranks = [TrainerActor.options(**opts).remote(r, self.world_size)
                      for r in range(self.world_size)]
        self.master = get(self.ranks[0].rendezvous.remote(), self.setup_timeout, "trainer rank 0")
        # a follower waits in the exporter's gathers while rank 0 runs the push, which ends by
        # the deadline: its group's timeout outlasts that, and `_timeout` outlasts both
        refs = [a.setup.remote(self.master, self.config, self.model, self.step, self.shard,
                               self.backend, self.deadline + 30.0, self.seed) for a in self.ranks]
        self.info = self._all(refs, self.setup_timeout, "setting up")
        return self

    def __enter__(self) -> "RayTrainer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _all(self, refs: Sequence[Any], timeout: float, doing: str) -> list[Any]:
        """Every rank's result. A rank that died, failed or hung is reported with what rank 0
        saw; a dead rank marks the trainer broken."""
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = {ref: r for r, ref in enumerate(refs)}
        while pending:
            left = deadline - time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not done:
                break
            for ref in done:
                r = pending.pop(ref)
                try:
                    results[r] = get(ref, 5.0, f"trainer rank {r}")
                except BaseException as e:  # noqa: BLE001 - reported per rank below
                    errors[r] = e
            if errors and any(isinstance(e, ActorGone) for e in errors.values()):
                # the survivors fail fast on the broken group; give them until the deadline
                continue
        for r in pending.values():
            errors[r] = TimeoutError(f"no answer within {timeout:g}s")
        if not errors:
            return [results[r] for r in range(len(refs))]
        dead = sorted(r for r, e in errors.items() if isinstance(e, ActorGone))
        first = errors.get(0)
        if not dead and isinstance(first, SyncError):
            raise first                       # a push that failed its engines: rank 0's report
        report = getattr(first, "report", None)
        lines = [f"rank {r}: {'died: ' if r in dead else ''}{_text(e)}"
                 for r, e in sorted(errors.items())]
        if dead:
            self.broken = (f"rank(s) {dead} died while {doing}; the trainer's process group is "
                           f"broken")
            msg = (f"trainer rank(s) {dead} died while {doing}; every engine keeps the last "
                   f"version it committed (an open round is aborted by rank 0, or by its lease). "
                   f"Restart the trainer.\n  " + "\n  ".join(lines))
        else:
            msg = f"the trainer failed while {doing}:\n  " + "\n  ".join(lines)
        raise TrainerError(msg, report if isinstance(report, SyncReport) else None)

    def _check(self) -> None:
        if not self.ranks:
            raise TrainerError("the trainer is not started: call start()")
        if self.broken:
            raise TrainerError(f"the trainer cannot push: {self.broken}; restart it")

    def _timeout(self) -> float:
        return self.deadline + 60.0        # the push bounds itself; this only catches a hang

    def push(self, version: int, before: Callable[[int], None] | None = None) -> SyncReport:
        """`push` on every rank; rank 0's report."""
        self._check()
        out = self._all([a.push.remote(version, before) for a in self.ranks], self._timeout(),
                        f"pushing version {version}")
        return SyncReport.from_json(out[0])

    def train_and_push(self, version: int, before: Callable[[int], None] | None = None
                       ) -> SyncReport:
        """One training step, then `push`, on every rank; rank 0's report."""
        self._check()
        out = self._all([a.train_and_push.remote(version, before) for a in self.ranks],
                        self._timeout(), f"training and pushing version {version}")
        return SyncReport.from_json(out[0])

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's whole model (gathered on rank 0)."""
        self._check()
        return self._all([a.weights.remote() for a in self.ranks], self._timeout(),
                         "gathering the weights")[0]

    def shutdown(self) -> None:
        """Close every rank and end the actors."""
        if self.ranks and not self.broken:
            try:
                ray.wait([a.close.remote() for a in self.ranks], num_returns=len(self.ranks),
                         timeout=30)
            except Exception as e:  # noqa: BLE001 - the actors are killed below anyway
                log.info("closing the trainer ranks failed: %s", e)
        for a in self.ranks:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.ranks = []


def _text(e: BaseException) -> str:
    if isinstance(e, (WeightSyncError, TimeoutError)):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{type(e).__name__}: {short(reason(e))}"
