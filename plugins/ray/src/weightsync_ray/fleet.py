"""Fleet `ray`: the members of a push are whoever registered with a named, detached Ray actor
(`roster.FleetActor`). Engine actors register themselves and renew their lease; the trainer
needs no handle to any of them, only the fleet's name and namespace.

This module imports nothing from Ray at import time: core registers the source through
`weightsync.builtin` on every install, and only `open()` needs Ray."""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from weightsync.config import EngineSpec
from weightsync.errors import ConfigError, WeightSyncError
from weightsync.interfaces import Fleet, Member
from weightsync_ray.roster import DEFAULT_NAME, DEFAULT_NAMESPACE

log = logging.getLogger("weightsync_ray")


class FleetError(WeightSyncError):
    """The fleet actor is gone or did not answer: no engine was contacted."""


class RayFleetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(DEFAULT_NAME, min_length=1, description="the fleet actor's name")
    namespace: str = Field(DEFAULT_NAMESPACE, min_length=1, description="its Ray namespace")
    address: str | None = Field(None, description="the Ray cluster, when this process is not "
                                                  "connected yet (None: RAY_ADDRESS or local)")
    create: bool = Field(True, description="start the fleet actor when there is none (and again "
                                           "when it was killed)")
    lease: float = Field(10.0, gt=0, le=3600, description="seconds a member stays without "
                                                          "renewing (for an actor started here)")
    peer_join: bool = Field(True, description="a member that is behind catches up from a peer")
    health_check: bool = Field(True, description="a member's engine must answer when it registers")
    timeout: float = Field(10.0, gt=0, description="seconds one call to the fleet actor may take")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray resources the fleet actor asks for (places it on a node that has them)"))


class RayFleet(Fleet):
    """Members from the fleet actor, asked at the start of every push."""

    name = "ray"
    Options = RayFleetOptions

    def __init__(self, options: Any = None, engines: list[Any] | None = None) -> None:
        super().__init__(options)
        if engines:
            raise ConfigError("`engines` lists a static fleet, but `fleet` is 'ray'; use one of "
                              "them (Ray engine actors register themselves)")
        self.actor: Any = None
        self.default_adapter: dict[str, Any] | None = None

    @property
    def what(self) -> str:
        return f"fleet actor {self.options.name!r} (Ray namespace {self.options.namespace!r})"

    def open(self, components: Any, default_adapter: Any) -> None:
        from weightsync_ray.runtime import connect
        connect(self.options.address)
        if default_adapter is not None:
            self.default_adapter = default_adapter.model_dump(mode="json")
        self.actor = self._find_or_start()
        settings = self._call("settings")
        if settings.get("lease") != self.options.lease:
            log.info("%s runs with lease %gs (this trainer's option says %gs; the running actor's "
                     "setting holds)", self.what, settings.get("lease"), self.options.lease)

    def _find_or_start(self) -> Any:
        from weightsync_ray.roster import find_fleet, start_fleet
        o = self.options
        if not o.create:
            return find_fleet(o.name, o.namespace)
        return start_fleet(o.name, o.namespace, lease=o.lease, peer_join=o.peer_join,
                           health_check=o.health_check, default_adapter=self.default_adapter,
                           resources=o.resources, timeout=max(o.timeout, 60.0))

    def _call(self, method: str, *args: Any) -> Any:
        """One call to the fleet actor. While Ray restarts it, the call waits for it (up to
        `timeout`). When it is gone: found again by name if someone started it anew, else (with
        `create`) started again for the next push; this call then fails with a FleetError that
        says so."""
        from weightsync_ray.runtime import ActorGone, ActorRestarting, get
        if self.actor is None:
            raise FleetError(f"{self.what} is not open: call open() first (WeightSync does)")
        until = time.monotonic() + self.options.timeout
        while True:
            try:
                return get(getattr(self.actor, method).remote(*args), self.options.timeout,
                           self.what)
            except ActorRestarting as e:
                if time.monotonic() > until:
                    raise FleetError(f"{e}; it was not back within {self.options.timeout:g}s; "
                                     f"no engine was contacted") from None
                time.sleep(0.25)
            except ActorGone as gone:
                return self._gone(gone, method, args)

    def _gone(self, gone: BaseException, method: str, args: tuple) -> Any:
        from weightsync_ray.runtime import ActorGone, get
        from weightsync_ray.roster import find_fleet
        try:
            self.actor = find_fleet(self.options.name, self.options.namespace)
            return get(getattr(self.actor, method).remote(*args), self.options.timeout, self.what)
        except ActorGone:
            pass
        what = f"{gone}; no engine was contacted"
        if self.options.create:
            try:
                self.actor = self._find_or_start()
                what += ("; a new fleet actor was started, and engine actors register with it "
                         "again within a third of their lease")
            except Exception as e:  # noqa: BLE001 - said in the error below
                what += f"; starting a new one failed too: {e}"
        raise FleetError(what) from None

    def members(self) -> list[Member]:
        out = []
        for m in self._call("members"):
            spec = EngineSpec.model_validate(m["spec"])
            out.append(Member(m["name"], spec, m.get("version"), dict(m.get("info") or {})))
        return out

    def excluded(self) -> dict[str, str]:
        return dict(self._call("excluded"))

    def anchor(self, version: int, buckets: list[Any]) -> None:
        """The push's digests, which peer joins check (see weightsync.fleets.peer)."""
        self._call("anchor", int(version), list(buckets))

    def synced(self, version: int, versions: Any) -> None:
        self._call("synced", int(version), dict(versions))

    def view(self) -> dict[str, Any]:
        """The fleet's version and each member's state, version and lease (what a router reads)."""
        return self._call("view")

    def close(self) -> None:
        """The fleet actor stays: it is detached, so members keep their registrations for the
        next trainer (`weightsync_ray.stop_fleet` ends it)."""
        self.actor = None
