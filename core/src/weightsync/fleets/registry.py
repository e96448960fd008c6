"""Fleet `registry`: members register at run time, with the trainer's own registry (on `host:port`)
or one at `url` (`weightsync fleet serve`). Without a fleet key it refuses to start unless the
config says `insecure: true`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from weightsync.config import ComponentRef, EngineSpec
from weightsync.errors import ConfigError
from weightsync.net.keys import resolve_key
from weightsync.interfaces import Fleet, Member
from weightsync.fleets.client import RegistryClient

__all__ = ["RegistryFleet", "RegistryOptions"]


class RegistryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description="a registry started with `weightsync fleet serve`; "
                                              "unset: run one in the trainer")
    host: str = Field("127.0.0.1", description="where the trainer's own registry listens")
    port: int = Field(0, ge=0, le=65535, description="its port (0: any free port)")
    api_key: str | None = Field(None, description="the registry's key (members and trainer send it)")
    api_key_file: str | None = Field(None, description="read the key from this file instead")
    trainer_key: str | None = Field(None, description="with `url`: the registry's trainer key "
                                                      "(reads engine keys, reports pushes)")
    trainer_key_file: str | None = Field(None, description="read the trainer key from this file")
    router_key: str | None = Field(None, description="the registry's router key: it reads the "
                                                     "members' rollout keys (generation only); "
                                                     "with `url` and no trainer key, the members "
                                                     "this fleet lists are those, for a router")
    router_key_file: str | None = Field(None, description="read the router key from this file")
    state_file: str | None = Field(None, description="keep the fleet's version, digests and "
                                                     "name bindings in this file (a restarted "
                                                     "trainer resumes them)")
    insecure: bool = Field(False, description="run the trainer's registry without a key "
                                              "(anyone who reaches it can join the fleet)")
    lease: float = Field(10.0, gt=0, le=3600, description="seconds a member stays without a heartbeat")
    peer_join: bool = Field(True, description="a member that is behind catches up from a peer")
    health_check: bool = Field(True, description="check a member's engine answers when it registers")


def require_key(key: str | None, insecure: bool) -> None:
    """A registry decides who gets the weights: it runs without a key only if told to."""
    if not key and not insecure:
        raise ConfigError("the fleet registry has no key: anyone who reaches it could join the "
                          "fleet and receive every push. Set api_key_file (or "
                          "$WEIGHTSYNC_FLEET_KEY; `--api-key-file` for `weightsync fleet "
                          "serve`), or say `insecure: true` (`--insecure`) for a test setup")


class RegistryFleet(Fleet):
    name = "registry"
    Options = RegistryOptions

    def __init__(self, options: Any = None, engines: list[Any] | None = None) -> None:
        super().__init__(options)
        self.service: Any = None
        self.client: RegistryClient | None = None
        self.url: str | None = None
        self.rollouts_only = False           # a router's view: rollout keys, not engine keys

    def open(self, components: Any, default_adapter: Any) -> None:
        o = self.options
        key = resolve_key(o.api_key, o.api_key_file, env="WEIGHTSYNC_FLEET_KEY")
        router = resolve_key(o.router_key, o.router_key_file, env="WEIGHTSYNC_FLEET_ROUTER_KEY")
        if o.url:
            trainer = resolve_key(o.trainer_key, o.trainer_key_file,
                                  env="WEIGHTSYNC_FLEET_TRAINER_KEY")
            self.client = RegistryClient(o.url, key, trainer_key=trainer, router_key=router)
            self.rollouts_only = router is not None and trainer is None
            self.url = o.url
            return
        from weightsync.net.keys import warn_if_open
        from weightsync.fleets.service import RegistryService
        require_key(key, o.insecure)
        self.service = RegistryService(components, lease=o.lease, api_key=key,
                                       peer_join=o.peer_join, health_check=o.health_check,
                                       default_adapter=default_adapter, state_file=o.state_file,
                                       router_key=router)
        warn_if_open(o.host, key, "the fleet registry")
        self.url = self.service.start(o.host, o.port)

    def version(self) -> int | None:
        """The last version a push committed to the fleet, as the registry recorded it."""
        if self.service is not None:
            return self.service.roster.current
        assert self.client is not None
        return self.client.fleet().get("version")

    def members(self) -> list[Member]:
        if self.service is not None:
            return self.service.members()
        assert self.client is not None
        out = []
        query = "rollouts=1" if self.rollouts_only else "with_keys=1"  # a router: rollout keys only
        for m in self.client._call("GET", f"/fleet?{query}")["members"]:
            reg = m.get("registration") or {}
            if m["state"] not in ("live", "behind"):
                continue
            if self.rollouts_only:
                r = m["rollout"]
                spec = EngineSpec(url=r["url"], name=m["name"], api_key=r.get("api_key"),
                                  adapter=ComponentRef(kind=r["adapter"]))
            elif m["role"] == "engine" and reg:
                spec = EngineSpec(url=reg["url"], name=reg["name"], api_key=reg.get("api_key"),
                                  adapter=ComponentRef.model_validate(reg.get("adapter") or "reference"),
                                  options=reg.get("options") or {})
            else:
                continue
            out.append(Member(m["name"], spec, m.get("version"), {"state": m["state"]}))
        return out

    def excluded(self) -> dict[str, str]:
        if self.service is not None:
            return self.service.excluded()
        assert self.client is not None
        out = {}
        for m in self.client.fleet()["members"]:
            if m["role"] == "engine" and m["state"] == "joining":
                out[m["name"]] = f"catching up from peer {m.get('via') or '?'}"
            elif m["role"] == "engine" and m["state"] == "lapsed":
                out[m["name"]] = m.get("error") or "lease lapsed"
        return out

    def anchor(self, version: int, buckets: list[Any]) -> None:
        """The push's digests (per bucket: tensor names, digest), which peer joins check."""
        if self.service is not None:
            self.service.set_anchor(version, buckets)
        else:
            self._anchor = (version, buckets)        # sent with synced()

    def synced(self, version: int, versions: Any) -> None:
        if self.service is not None:
            self.service.synced(version, dict(versions))
        elif self.client is not None:
            pending = getattr(self, "_anchor", None)
            anchor = pending[1] if pending and pending[0] == version else None
            self.client.synced(version, dict(versions), anchor)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        if self.client is not None:
            self.client.close()
