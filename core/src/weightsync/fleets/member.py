"""A member's side of the fleet: register, heartbeat every third of the lease, register again with
its own credential when the registry forgot or refuses it (saying why in `error`), deregister on
the way out. Runs next to the engine (`weightsync serve --fleet`) or in `weightsync join`."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from weightsync.fleets.client import RegistryClient, RegistryError

__all__ = ["Membership", "wait_healthy"]

log = logging.getLogger("weightsync.fleets")


class Membership:
    """`credential_file` keeps the credential (0600): a restart takes the name back at once."""

    def __init__(self, registry: str, key: str | None, registration: dict[str, Any],
                 version: Callable[[], int | None] | None = None,
                 credential_file: str | Path | None = None) -> None:
        self.client = RegistryClient(registry, key)
        self.registration = dict(registration)
        self.name = str(registration["name"])
        self.version = version or (lambda: None)
        self.every, self.registered = 1.0, False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.credential_file = Path(credential_file) if credential_file else None
        self.credential: str | None = None       # this member's own, from the registry
        if self.credential_file is not None and self.credential_file.is_file():
            self.credential = self.credential_file.read_text().strip() or None
        self.error: str | None = None            # why the registry does not have it now

    def register(self) -> dict[str, Any]:
        out = self.client.register({**self.registration, "version": self.version()},
                                   self.credential)
        self.credential = out.get("credential")
        if self.credential_file is not None and self.credential:
            self._keep(self.credential_file, self.credential)
        self.every = max(0.2, float(out.get("lease", 3.0)) / 3)
        self.registered = True
        log.info("registered %s with the fleet registry %s (lease %.1fs)", self.name,
                 self.client.url, float(out.get("lease", 0)))
        return out

    @staticmethod
    def _keep(path: Path, credential: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(credential)
        os.replace(tmp, path)

    def start(self) -> "Membership":
        self.register()
        self._thread = threading.Thread(target=self._run, name="ws-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.client.heartbeat(self.name, self.version(), self.credential)
                self.error = None
            except RegistryError as e:
                if "is not registered" in str(e) or "another credential" in str(e):
                    try:                          # the registry restarted or holds another
                        self.register()
                        self.error = None
                    except RegistryError as e2:
                        self.error = f"registering {self.name} again failed: {e2}"
                        log.error("%s", self.error)
                else:
                    self.error = f"heartbeat of {self.name} failed: {e}"
                    log.warning("%s", self.error)

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
