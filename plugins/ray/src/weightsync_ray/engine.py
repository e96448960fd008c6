"""An engine as a Ray actor: it starts the engine's process on the node Ray placed it on, waits
for the engine's health, registers it with the fleet actor and renews its lease. The process is
bound to the actor (`process.ManagedProcess`): if either dies, both do, and Ray restarts the
actor (`max_restarts`), which starts a fresh engine that registers again, at the version its
checkpoint holds. The fleet then catches it up from a current peer before pushes (and, through
`ready`, rollouts) reach it.

    fleet = start_fleet("policy", "rl")
    engine = start_engine("e1", EngineLaunch(model="/models/policy"), fleet=("policy", "rl"),
                          resources={"rollout": 1})
    info = wait_ready([engine], timeout=300)[0]    # {"url": ..., "version": ...}
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import ray

from weightsync.config import EngineSpec, build_options
from weightsync.errors import WeightSyncError
from weightsync.net.server import free_port
from weightsync_ray.runtime import ActorGone, ActorRestarting, get, node_ip, restarted
from weightsync_ray.launch import EngineLaunch, command, describe
from weightsync_ray.membership import ActorMembership
from weightsync_ray.process import ManagedProcess, crash_actor

__all__ = ["EngineActor", "EngineRunner", "EngineStartError", "FleetRef", "placement",
           "start_engine", "stop_actors", "wait_ready"]

log = logging.getLogger("weightsync_ray")

FleetRef = tuple[str, str]            # (fleet actor name, Ray namespace)


class EngineStartError(WeightSyncError):
    """The engine's process did not start, or did not become healthy in time."""


class EngineRunner:
    """The actor's body (`EngineActor` is this class under `ray.remote`)."""

    def __init__(self, name: str, launch: EngineLaunch | dict[str, Any],
                 fleet: FleetRef | None = None, log_dir: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        ctx = ray.get_runtime_context()
        self.name, self.launch = name, describe(launch)
        self.actor_id = ctx.get_actor_id()
        self.restarted = restarted(ctx)
        self.node_ip, self.node_id = node_ip(), ctx.get_node_id()
        self.log_dir = Path(log_dir or tempfile.gettempdir())
        self.starting = True
        self.process: ManagedProcess | None = None
        self.membership: ActorMembership | None = None
        self.adapter_cls = self._adapter_cls()
        self._probe: Any = None                   # the adapter the lease thread asks for versions
        self._probe_lock = threading.Lock()
        try:
            self._start_engine()
            self.starting = False
            if fleet is not None:
                self.membership = ActorMembership(
                    fleet[0], fleet[1], self._registration(), self._version, self.actor_id)
                self.membership.start(required=False)
        except BaseException:
            self.shutdown()
            raise
        log.info("engine %s serving at %s on node %s%s", name, self.url, self.node_ip,
                 " (restarted by Ray)" if self.restarted else "")

    # -- starting ---------------------------------------------------------------------------
    def _adapter_cls(self) -> Any:
        from weightsync.plugins import load_components
        return load_components().adapters.get(self.launch.adapter.kind)

    def _start_engine(self) -> None:
        """Start the process and wait for its health; a port someone took meanwhile is tried
        again on another one."""
        for attempt in range(3):
            host = self.launch.host or self.node_ip
            port = self.launch.port or free_port(host)
            self.url = f"http://{self.node_ip if host in ('0.0.0.0', '::') else host}:{port}"
            argv, env = command(self.launch, host, port, self.name)
            path = self.log_dir / f"weightsync-engine-{self.name}-{os.getpid()}-{attempt}.log"
            self.process = ManagedProcess(argv, path, env={**os.environ, **env},
                                          on_exit=self._exited).start()
            try:
                self._wait_healthy()
                return
            except EngineStartError:
                busy = "address already in use" in self.process.tail(40).lower()
                self.process.stop()
                if not busy or self.launch.port or attempt == 2:
                    raise

    def _spec(self) -> EngineSpec:
        return EngineSpec(url=self.url, name=self.name, api_key=self.launch.api_key,
                          adapter=self.launch.adapter)

    def _client(self) -> Any:
        cls = self.adapter_cls
        return cls(build_options(cls, self.launch.adapter, "adapter"), self._spec())

    def _wait_healthy(self) -> None:
        assert self.process is not None
        client = self._client()
        deadline = time.monotonic() + self.launch.start_timeout
        last: BaseException | None = None
        try:
            while time.monotonic() < deadline:
                code = self.process.exit_code()
                if code is not None:
                    raise EngineStartError(
                        f"engine {self.name} on node {self.node_ip} exited with code {code} "
                        f"while starting ({' '.join(self.process.argv[:6])} ...); the last lines "
                        f"of {self.process.log_path}:\n{self.process.tail()}")
                try:
                    client.health()
                    return
                except Exception as e:  # noqa: BLE001 - retried until the deadline
                    last = e
                time.sleep(0.2)
        finally:
            client.close()
        raise EngineStartError(f"engine {self.name} on node {self.node_ip} did not answer its "
                               f"health check within {self.launch.start_timeout:g}s ({last}); "
                               f"the last lines of {self.process.log_path}:\n{self.process.tail()}")

    def _registration(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "adapter": self.launch.adapter.model_dump(),
                "api_key": self.launch.api_key, "role": "engine"}

    def _version(self) -> int | None:
        """The version the engine holds (None: it does not answer)."""
        with self._probe_lock:
            if self._probe is None:
                self._probe = self._client()
            try:
                return self._probe.health().version
            except Exception:  # noqa: BLE001 - an engine that does not answer reports no version
                return None

    def _exited(self, code: int) -> None:
        if not self.starting:
            crash_actor(f"engine {self.name} at {self.url} exited with code {code}")

    # -- what callers ask ---------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Where the engine runs and what it holds (JSON)."""
        return {"name": self.name, "url": self.url, "node_ip": self.node_ip,
                "node_id": self.node_id, "actor_pid": os.getpid(),
                "engine_pid": self.process.pid if self.process else None,
                "restarted": self.restarted, "version": self._version(),
                "log": str(self.process.log_path) if self.process else None,
                "fleet_error": self.membership.last_error if self.membership else None}

    def ready(self, timeout: float = 300.0, min_version: int | None = None) -> dict[str, Any]:
        """Block until the engine may take rollouts: registered, live in the fleet and at the
        fleet's version (caught up after a restart), or at `min_version` without a fleet."""
        deadline = time.monotonic() + timeout
        if self.membership is None:
            while True:
                v = self._version()
                if v is not None and (min_version is None or v >= min_version):
                    return self.info()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {self.name} holds version {v}, not {min_version}, "
                                       f"after {timeout:g}s")
                time.sleep(0.2)
        m = self.membership
        while not m.registered:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} is not registered with {m.what} after "
                                   f"{timeout:g}s: {m.last_error}")
            time.sleep(0.1)
        left = max(0.1, deadline - time.monotonic())
        get(m.fleet().wait_member.remote(self.name, left, min_version), left + 10, m.what)
        return self.info()

    def kill_engine(self) -> None:
        """SIGKILL the engine's process, as a crash would (this actor then exits and Ray
        restarts it)."""
        if self.process is not None:
            self.process.kill()

    def shutdown(self) -> None:
        """Deregister and stop the engine (SIGTERM, then SIGKILL); the actor stays until killed."""
        self.starting = True                      # an exit from here on is not a crash
        if self.membership is not None:
            self.membership.stop()
        if self.process is not None:
            self.process.stop()
        with self._probe_lock:
            if self._probe is not None:
                self._probe.close()
                self._probe = None


EngineActor = ray.remote(num_cpus=0, max_restarts=3)(EngineRunner)


def placement(resources: dict[str, float] | None = None, node_id: str | None = None
              ) -> dict[str, Any]:
    """Ray actor options that place an actor: on nodes with `resources`, or on `node_id`."""
    opts: dict[str, Any] = {}
    if resources:
        opts["resources"] = dict(resources)
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return opts


def start_engine(name: str, launch: EngineLaunch | dict[str, Any], *,
                 fleet: FleetRef | None = None, resources: dict[str, float] | None = None,
                 node_id: str | None = None, max_restarts: int = 3,
                 log_dir: str | None = None, **actor_options: Any) -> Any:
    """An engine actor named `name` (also its Ray actor name), placed by `resources` or
    `node_id`; returns its handle at once (`wait_ready` waits for it)."""
    opts = {"max_restarts": max_restarts, **placement(resources, node_id), **actor_options}
    return EngineActor.options(**opts).remote(name, describe(launch).model_dump(mode="json"),
                                              fleet, log_dir)


def wait_ready(handles: Sequence[Any], timeout: float = 300.0,
               min_version: int | None = None) -> list[dict[str, Any]]:
    """`ready()` of every engine actor, waiting through restarts until `timeout`. An actor
    that died for good (its engine failed to start) raises EngineStartError with the reason."""
    deadline = time.monotonic() + timeout
    refs = {i: h.ready.remote(timeout, min_version) for i, h in enumerate(handles)}
    out: dict[int, dict[str, Any]] = {}
    while refs:
        i, ref = next(iter(refs.items()))
        left = max(0.1, deadline - time.monotonic())
        try:
            out[i] = get(ref, left + 10, f"engine actor {i}")
            del refs[i]
        except ActorRestarting:
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine actor {i} was still restarting after "
                                       f"{timeout:g}s") from None
            time.sleep(0.5)
            refs[i] = handles[i].ready.remote(max(0.1, deadline - time.monotonic()), min_version)
        except ActorGone as e:
            raise EngineStartError(f"engine actor {i} cannot serve: {e}") from None
    return [out[i] for i in range(len(handles))]


def stop_actors(handles: Sequence[Any], timeout: float = 30.0) -> None:
    """Engine or pull-agent actors: deregister and stop each one's process, then end the actor
    for good (no restart)."""
    refs = [h.shutdown.remote() for h in handles]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    finally:
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
