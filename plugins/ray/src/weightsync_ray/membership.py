"""A member's side of the Ray fleet, run inside an engine or agent actor: register with the fleet
actor (found by name), renew the lease every third of it with the version the engine holds,
register again when the fleet forgot the member (the fleet actor restarted, or was started anew),
and deregister on the way out. The same job as `fleets.member.Membership`, over Ray calls."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from weightsync_ray.runtime import ActorGone, get
from weightsync_ray.roster import FleetRefused, NotRegistered, find_fleet

__all__ = ["ActorMembership"]

log = logging.getLogger("weightsync_ray")


class ActorMembership:
    def __init__(self, name: str, namespace: str, registration: dict[str, Any],
                 version: Callable[[], int | None], owner: str | None,
                 timeout: float = 10.0) -> None:
        self.fleet_name, self.namespace = name, namespace
        self.registration = dict(registration)
        self.member = str(registration["name"])
        self.version, self.owner, self.timeout = version, owner, timeout
        self.every = 1.0
        self.handle: Any = None
        self.registered = False
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def what(self) -> str:
        return f"fleet actor {self.fleet_name!r} (Ray namespace {self.namespace!r})"

    def fleet(self) -> Any:
        """The fleet actor's handle, found by name when there is none yet."""
        if self.handle is None:
            self.handle = find_fleet(self.fleet_name, self.namespace)
        return self.handle

    def register(self) -> dict[str, Any]:
        """Register now. FleetRefused when the fleet says no (the message says why); ActorGone
        when there is no fleet actor to ask."""
        reg = {**self.registration, "version": self.version()}
        try:
            out = get(self.fleet().register.remote(reg, self.owner), self.timeout, self.what)
        except ActorGone:
            self.handle = None
            raise
        self.every = max(0.2, float(out.get("lease", 3.0)) / 3)
        self.registered = True
        self.last_error = None
        log.info("%s registered with %s (lease %.1fs)", self.member, self.what,
                 float(out.get("lease", 0)))
        return out

    def start(self, *, required: bool = True) -> "ActorMembership":
        """Register, then renew on a thread. A missing fleet actor is waited for on that thread
        unless `required`; a refusal always raises."""
        try:
            self.register()
        except ActorGone as e:
            if required:
                raise
            self.last_error = str(e)
            log.warning("%s: %s; registering when it appears", self.member, e)
        self._thread = threading.Thread(target=self._run, name="ws-ray-lease", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                if not self.registered:
                    self.register()
                    continue
                get(self.fleet().heartbeat.remote(self.member, self.version()), self.timeout,
                    self.what)
                self.last_error = None
            except NotRegistered:
                self.registered = False          # the fleet restarted: its state is leases
                try:
                    self.register()
                except Exception as e:  # noqa: BLE001 - tried again next period
                    self.last_error = str(e)
            except ActorGone as e:
                self.handle, self.registered = None, False
                if self.last_error != str(e):
                    log.warning("%s: %s; registering again when it is back", self.member, e)
                self.last_error = str(e)
            except FleetRefused as e:
                self.last_error = str(e)
                log.warning("%s: the fleet refused: %s", self.member, e)
            except Exception as e:  # noqa: BLE001 - the lease thread must outlive one failure
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("%s: renewing the lease failed: %s", self.member, self.last_error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.registered and self.handle is not None:
            try:
                get(self.handle.deregister.remote(self.member, self.owner), self.timeout, self.what)
            except Exception as e:  # noqa: BLE001 - leaving: the lease lapses anyway
                log.info("%s: deregistering failed (%s); its lease lapses", self.member, e)
        self.registered = False
