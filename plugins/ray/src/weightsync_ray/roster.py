"""The fleet's membership as a named, detached Ray actor. It holds the same state as the HTTP
registry (`fleets.roster`: members, leases, versions, states) and runs the same catch-up (peer
join), but members and trainers reach it by name through Ray calls: an engine actor registers
itself and renews its lease, and a trainer asks who is live, so nobody holds a handle to anybody
else. Detached, it outlives the trainer that started it; Ray restarts it if its process dies, and
members then register again (its only state is their leases).

Only plain data crosses it (dicts of str/int/float), as in the registry's JSON."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from weightsync.config import ComponentRef
from weightsync.errors import WeightSyncError
from weightsync_ray.runtime import ActorGone, connect, get, require_ray

log = logging.getLogger("weightsync_ray")

DEFAULT_NAME = "weightsync-fleet"
DEFAULT_NAMESPACE = "weightsync"


class FleetRefused(WeightSyncError):
    """The fleet actor refused a registration or heartbeat; the message says why."""


class NotRegistered(FleetRefused):
    """A heartbeat for a name the fleet does not know (it restarted): register again."""


class FleetActor:
    """The actor's body (wrapped by `ray.remote` in `fleet_actor_class`). A RegistryService
    without its HTTP server: the registry's rules (names, health check, states, catch-up) hold
    unchanged."""

    def __init__(self, lease: float = 10.0, peer_join: bool = True, health_check: bool = True,
                 default_adapter: dict[str, Any] | None = None) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from weightsync.fleets.service import RegistryService
        from weightsync.plugins import load_components
        ref = ComponentRef.model_validate(default_adapter) if default_adapter else None
        self.service = RegistryService(load_components(), lease=lease, peer_join=peer_join,
                                       health_check=health_check, default_adapter=ref)
        self.service.catchup.start()
        self.settings_ = {"lease": lease, "peer_join": peer_join, "health_check": health_check}
        self.owners: dict[str, str | None] = {}       # member name -> the Ray actor that holds it
        self.lock = threading.Lock()

    def settings(self) -> dict[str, Any]:
        return dict(self.settings_)

    def ping(self) -> str:
        return "ok"

    def register(self, registration: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """Register a member. `owner` is the Ray actor id of the member's actor: when that same
        actor comes back after a restart (Ray keeps its id) at another URL, it takes its name
        back at once instead of waiting for its old lease to lapse."""
        from weightsync.net.server import HttpError
        name = str(registration.get("name", ""))
        roster = self.service.roster
        with self.lock:
            with roster.lock:
                old = roster.members.get(name)
                if owner is not None and self.owners.get(name) == owner:
                    roster.members.pop(name, None)     # the same actor: Ray vouches for it
                    roster.bindings.pop(name, None)
                    log.info("member %s came back at %s (was %s): its old entry is replaced",
                             name, registration.get("url"), old.reg.url if old else "gone")
            try:
                out = self.service.register(registration)
            except HttpError as e:
                raise FleetRefused(str(e)) from None
            self.owners[name] = owner
            # a new registration is a new engine: a catch-up that failed for the member's old
            # incarnation (its dead URL) must not hold the new one back for the cooldown
            self.service.catchup.failed.pop(name, None)
        return out

    def heartbeat(self, name: str, version: int | None = None) -> dict[str, Any]:
        from weightsync.net.server import HttpError
        if version is not None and (not isinstance(version, int) or version < 0):
            raise FleetRefused(f"version must be a non-negative integer, got {version!r}")
        try:
            m = self.service.roster.heartbeat(name, version)
        except HttpError as e:
            raise NotRegistered(str(e)) from None
        self.service.catchup.poke()
        return m.view(0.0) | {"lease": self.service.roster.lease}

    def deregister(self, name: str, owner: str | None = None) -> bool:
        """Remove `name`; with `owner`, only if that actor still holds it. False: not there."""
        from weightsync.net.server import HttpError
        with self.lock:
            if owner is not None and self.owners.get(name) not in (None, owner):
                return False
            try:
                self.service.roster.deregister(name)
            except HttpError:
                return False
            self.owners.pop(name, None)
        return True

    def members(self) -> list[dict[str, Any]]:
        """What a push starting now must reach (engines, live or behind), with their keys."""
        return [{"name": m.name, "spec": m.spec.model_dump(mode="json"), "version": m.version,
                 "info": dict(m.info)} for m in self.service.members()]

    def excluded(self) -> dict[str, str]:
        return self.service.excluded()

    def anchor(self, version: int, buckets: list[Any]) -> None:
        from weightsync.net.server import HttpError
        try:
            self.service.set_anchor(int(version), buckets)
        except HttpError as e:
            raise FleetRefused(str(e)) from None

    def synced(self, version: int, versions: dict[str, int | None]) -> None:
        self.service.roster.synced(int(version), {str(k): (None if v is None else int(v))
                                                  for k, v in versions.items()})
        self.service.catchup.poke()

    def view(self) -> dict[str, Any]:
        """What `GET /fleet` shows: the fleet's version and every member's state (no keys)."""
        self.service.roster.expire()
        return self.service.roster.view()

    def wait_member(self, name: str, timeout: float, min_version: int | None = None
                    ) -> dict[str, Any]:
        """Block until member `name` is live and holds the fleet's version (or `min_version`):
        caught up, so it may take rollouts. Returns its view; raises TimeoutError saying where
        it stands."""
        roster = self.service.roster
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            roster.expire()
            with roster.lock:
                m = roster.members.get(name)
                want = min_version if min_version is not None else roster.current
                if m is not None:
                    last = m.view(time.monotonic())
                    if m.state == "live" and (want is None or (m.version or 0) >= want):
                        return last
            if time.monotonic() >= deadline:
                where = ("is not registered" if last is None else
                         f"is {last['state']} at version {last['version']}"
                         + (f" ({last['error']})" if last.get("error") else ""))
                raise TimeoutError(f"member {name!r} {where}, not live at version {want} "
                                   f"after {timeout:g}s")
            time.sleep(0.1)

    def close(self) -> None:
        self.service.close()


@functools.cache
def fleet_actor_class() -> Any:
    """FleetActor as a Ray actor class: restarted by Ray when its process dies, threaded so a
    member waiting in `wait_member` never holds up heartbeats."""
    ray = require_ray()
    return ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=32)(FleetActor)


def start_fleet(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *,
                lease: float = 10.0, peer_join: bool = True, health_check: bool = True,
                default_adapter: dict[str, Any] | None = None,
                resources: dict[str, float] | None = None, timeout: float = 60.0) -> Any:
    """The fleet actor `name` in `namespace`: the running one, or a new detached one. Returns
    its handle once it answers."""
    connect()
    cls = fleet_actor_class()
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "lifetime": "detached",
                            "get_if_exists": True}
    if resources:
        opts["resources"] = dict(resources)
    handle = cls.options(**opts).remote(lease=lease, peer_join=peer_join,
                                        health_check=health_check, default_adapter=default_adapter)
    get(handle.ping.remote(), timeout, f"fleet actor {name!r} (namespace {namespace!r})")
    return handle


def find_fleet(name: str, namespace: str) -> Any:
    """The fleet actor's handle by name, or ActorGone when there is none."""
    ray = require_ray()
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ActorGone(f"there is no fleet actor {name!r} in Ray namespace {namespace!r}: "
                        f"start one (a trainer with fleet kind 'ray' and create: true does, or "
                        f"weightsync_ray.start_fleet)") from None


def stop_fleet(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE,
               timeout: float = 30.0) -> bool:
    """Kill the fleet actor for good (it is detached: nothing else ends it) and return once Ray
    no longer finds it by name: `ray.kill` returns before the actor is dead, and a call made
    meanwhile was still answered by it. False: none. TimeoutError: still there at `timeout`."""
    ray = require_ray()
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(0.05)
    raise TimeoutError(f"fleet actor {name!r} (Ray namespace {namespace!r}) was killed but is "
                       f"still found after {timeout:g}s")
