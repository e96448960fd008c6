"""Talking to a fleet registry over HTTP: register, heartbeat, deregister, list, report pushes."""

from __future__ import annotations

from typing import Any

import requests

from weightsync.errors import WeightSyncError
from weightsync.net.client import auth_headers, error_text

__all__ = ["RegistryClient", "RegistryError"]


class RegistryError(WeightSyncError):
    """The registry refused a request or could not be reached; the message says which."""


class RegistryClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0,
                 trainer_key: str | None = None, router_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = auth_headers(api_key)
        if trainer_key:
            self.headers["X-Weightsync-Trainer"] = trainer_key
        if router_key:
            self.headers["X-Weightsync-Router"] = router_key
        self.timeout = timeout
        self.session = requests.Session()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            r = self.session.request(method, self.url + path, json=body, headers=self.headers,
                                     timeout=self.timeout)
        except requests.RequestException as e:
            raise RegistryError(f"fleet registry {self.url} cannot be reached "
                                f"({type(e).__name__}); is it running at that address?") from None
        if r.status_code != 200:
            raise RegistryError(f"fleet registry {self.url}: {method} {path} -> HTTP "
                                f"{r.status_code}: {error_text(r)}")
        return r.json() if r.content else {}

    def register(self, registration: dict[str, Any], credential: str | None = None
                 ) -> dict[str, Any]:
        """The registry's answer; every later call about this member carries its "credential"."""
        return self._call("POST", "/fleet/register",
                          dict(registration) | ({"credential": credential} if credential else {}))

    def heartbeat(self, name: str, version: int | None = None, credential: str | None = None
                  ) -> dict[str, Any]:
        return self._call("POST", "/fleet/heartbeat",
                          {"name": name, "version": version, "credential": credential})

    def deregister(self, name: str, credential: str | None = None) -> None:
        self._call("POST", "/fleet/deregister", {"name": name, "credential": credential})

    def fleet(self) -> dict[str, Any]:
        return self._call("GET", "/fleet")

    def synced(self, version: int, versions: dict[str, int | None],
               anchor: list[Any] | None = None) -> None:
        self._call("POST", "/fleet/synced", {"version": version, "versions": versions}
                   | ({"anchor": anchor} if anchor is not None else {}))

    def close(self) -> None:
        self.session.close()
