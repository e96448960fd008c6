"""A member's side of the fleet: register, heartbeat every third of the lease with the version
it holds, register again when the registry forgot it (it restarted), deregister on the way out.
Runs on a thread next to the engine (`weightsync serve --fleet`) or in a sidecar
(`weightsync join`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from weightsync.fleets.client import RegistryClient, RegistryError

__all__ = ["Membership", "wait_healthy"]

log = logging.getLogger("weightsync.fleets")


class Membership:
    def __init__(self, registry: str, key: str | None, registration: dict[str, Any],
                 version: Callable[[], int | None] | None = None) -> None:
        self.client = RegistryClient(registry, key)
        self.registration = dict(registration)
        self.name = str(registration["name"])
        self.version = version or (lambda: None)
        self.every = 1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False
        self.credential: str | None = None       # this member's own, from the registry

    def register(self) -> dict[str, Any]:
        out = self.client.register({**self.registration, "version": self.version()},
                                   self.credential)
        self.credential = out.get("credential")
        self.every = max(0.2, float(out.get("lease", 3.0)) / 3)
        self.registered = True
        log.info("registered %s with the fleet registry %s (lease %.1fs)", self.name,
                 self.client.url, float(out.get("lease", 0)))
        return out

    def start(self) -> "Membership":
        self.register()
        self._thread = threading.Thread(target=self._run, name="ws-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.client.heartbeat(self.name, self.version(), self.credential)
            except RegistryError as e:
                if "is not registered" in str(e):
                    try:
                        self.register()          # the registry restarted: its state is leases
                    except RegistryError as e2:
                        log.warning("registering %s again failed: %s", self.name, e2)
                else:
                    log.warning("heartbeat of %s failed: %s", self.name, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.registered:
            try:
                self.client.deregister(self.name, self.credential)
                log.info("deregistered %s", self.name)
            except RegistryError as e:
                log.warning("deregistering %s failed: %s", self.name, e)
        self.client.close()


def wait_healthy(check: Callable[[], Any], timeout: float, what: str) -> None:
    """Call `check` until it succeeds or `timeout` passes (a sidecar waits for its engine)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            check()
            return
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
            time.sleep(0.5)
    raise RegistryError(f"{what} did not become healthy within {timeout:g}s: {last}")
