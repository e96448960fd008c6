"""The disk_delta pull agent as a Ray actor, one per node: it runs `weightsync-disk-delta agent`
(the plugin's own command) on its node, following the published root into a node-local
checkpoint and reloading the node's engine from it, and registers the node with the fleet actor
as a `host` (never pushed to; the fleet view shows the version it holds). Same lifecycle as an
engine actor: the agent's process and the actor live and die together, and Ray restarts the
actor, whose new agent picks up where the checkpoint stands (the plugin's journal makes a killed
agent safe). Needs `weightsync-disk-delta[ray]`."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

from weightsync.config import ComponentRef, EngineSpec, build_options
from weightsync_ray.runtime import node_ip, restarted
from weightsync_ray.engine import EngineStartError, FleetRef, placement
from weightsync_ray.membership import ActorMembership
from weightsync_ray.process import ManagedProcess, crash_actor

log = logging.getLogger("weightsync_ray")

STARTED = "agent: following"          # the agent's first line once it runs


class PullAgentRunner:
    """The actor's body (`PullAgentActor` is this class under `ray.remote`)."""

    def __init__(self, name: str, root: str, local: str, engine_url: str | None = None,
                 engine: str = "reference", api_key: str | None = None,
                 fleet: FleetRef | None = None, interval: float = 0.2,
                 log_dir: str | None = None, start_timeout: float = 120.0) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        ctx = ray.get_runtime_context()
        self.name, self.root, self.local = name, root, local
        self.engine, self.engine_url, self.api_key = engine, engine_url, api_key
        self.node_ip, self.node_id = node_ip(), ctx.get_node_id()
        self.restarted = restarted(ctx)
        self.starting = True
        self.membership: ActorMembership | None = None
        self.probe = self._probe() if engine_url else None
        self.probe_lock = threading.Lock()
        argv = [sys.executable, "-m", "weightsync_disk_delta.cli", "agent", "--root", root,
                "--local", local, "--interval", str(interval)]
        if engine_url:
            argv += ["--engine", engine, "--url", engine_url]
            if api_key:
                argv += ["--api-key", api_key]
        else:
            argv += ["--engine", "none"]
        path = Path(log_dir or tempfile.gettempdir()) / f"weightsync-agent-{name}-{os.getpid()}.log"
        self.process = ManagedProcess(argv, path, on_exit=self._exited).start()
        try:
            self._wait_started(start_timeout)
            self.starting = False
            if fleet is not None:
                url = engine_url or f"http://{self.node_ip}"
                kind = engine if engine_url else "reference"
                self.membership = ActorMembership(
                    fleet[0], fleet[1], {"name": name, "url": url, "role": "host",
                                         "adapter": {"kind": kind}},
                    self.version, ctx.get_actor_id())
                self.membership.start(required=False)
        except BaseException:
            self.shutdown()
            raise

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.exit_code()
            if code is not None:
                raise EngineStartError(f"pull agent {self.name} on node {self.node_ip} exited with "
                                       f"code {code} while starting; the last lines of "
                                       f"{self.process.log_path}:\n{self.process.tail()}")
            if STARTED in self.process.tail(50):
                return
            time.sleep(0.1)
        raise EngineStartError(f"pull agent {self.name} on node {self.node_ip} did not start "
                               f"within {timeout:g}s:\n{self.process.tail()}")

    def _exited(self, code: int) -> None:
        if not self.starting:
            crash_actor(f"pull agent {self.name} exited with code {code}")

    def _probe(self) -> Any:
        """The adapter that asks the node's engine for its version."""
        from weightsync.plugins import load_components
        cls = load_components().adapters.get(self.engine)
        return cls(build_options(cls, ComponentRef(kind=self.engine), "adapter"),
                   EngineSpec(url=self.engine_url, api_key=self.api_key))

    def version(self) -> int | None:
        """The version the node's engine holds (what the agent last loaded into it)."""
        if self.probe is None:
            return None
        with self.probe_lock:
            try:
                return self.probe.health().version
            except Exception:  # noqa: BLE001 - an engine that does not answer reports no version
                return None

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "node_ip": self.node_ip, "node_id": self.node_id,
                "actor_pid": os.getpid(), "agent_pid": self.process.pid,
                "restarted": self.restarted, "version": self.version(),
                "log": str(self.process.log_path),
                "fleet_error": self.membership.last_error if self.membership else None}

    def ready(self, timeout: float = 300.0, min_version: int | None = None) -> dict[str, Any]:
        """Block until the node's engine holds `min_version` (or any version)."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.version()
            if v is not None and (min_version is None or v >= min_version):
                return self.info()
            if time.monotonic() > deadline:
                raise TimeoutError(f"pull agent {self.name}: the engine holds version {v}, not "
                                   f"{min_version}, after {timeout:g}s; the agent says:\n"
                                   f"{self.process.tail(8)}")
            time.sleep(0.2)

    def kill_agent(self) -> None:
        """SIGKILL the agent's process, as a crash would (Ray then restarts this actor)."""
        self.process.kill()

    def shutdown(self) -> None:
        self.starting = True
        if self.membership is not None:
            self.membership.stop()
        self.process.stop()
        if self.probe is not None:
            self.probe.close()


PullAgentActor = ray.remote(num_cpus=0, max_restarts=3)(PullAgentRunner)


def start_agent(name: str, root: str, local: str, *, engine_url: str | None = None,
                engine: str = "reference", api_key: str | None = None,
                fleet: FleetRef | None = None, node_id: str | None = None,
                resources: dict[str, float] | None = None, max_restarts: int = 3,
                interval: float = 0.2, log_dir: str | None = None, **actor_options: Any) -> Any:
    """A pull-agent actor on `node_id` (the node of the engine it reloads) or on nodes with
    `resources`; `local` is a directory on that node."""
    opts = {"max_restarts": max_restarts, **placement(resources, node_id), **actor_options}
    return PullAgentActor.options(**opts).remote(name, root, local, engine_url, engine, api_key,
                                                 fleet, interval, log_dir)
