"""The registry's state: members, their leases, versions and states. Small on purpose: it is
rebuilt from heartbeats when the registry restarts, so nothing here needs to outlive a process.

States: `live` (in every push), `joining` (catching up from a peer; pushes skip it),
`behind` (could not catch up from a peer; the next push sends it whole tensors),
`lapsed` (its lease ran out: excluded until it heartbeats or registers again)."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import ComponentRef, EngineSpec
from ..httpserver import Conflict409, HttpError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$")
State = Literal["live", "joining", "behind", "lapsed"]


class Registration(BaseModel):
    """What a member sends to register (JSON)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    url: str
    adapter: ComponentRef = ComponentRef(kind="reference")
    options: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None
    group_size: int = Field(1, ge=1, le=4096)
    version: int | None = Field(None, ge=0)
    role: Literal["engine", "host"] = "engine"     # host: a disk puller, never pushed to

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"member name {v!r} must be 1-128 letters, digits or _.:@- "
                             f"(starting with a letter or digit)")
        return v

    def spec(self) -> EngineSpec:
        return EngineSpec(url=self.url, name=self.name, api_key=self.api_key, adapter=self.adapter,
                          options=self.options)


@dataclass
class MemberState:
    reg: Registration
    expires: float
    state: State = "live"
    version: int | None = None
    since: float = field(default_factory=time.time)
    error: str | None = None
    pulled: int = 0                          # times it caught up from a peer
    via: str | None = None                   # the peer it last pulled from
    serving: int = 0                         # joiners pulling from it now

    def view(self, now: float) -> dict[str, Any]:
        return {"name": self.reg.name, "url": self.reg.url, "adapter": self.reg.adapter.kind,
                "role": self.reg.role, "version": self.version, "state": self.state,
                "lease_left": round(max(0.0, self.expires - now), 3), "since": self.since,
                "error": self.error, "pulled_from_peer": self.pulled, "via": self.via,
                "group_size": self.reg.group_size}


class Roster:
    """Members by name, under one lock."""

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self.members: dict[str, MemberState] = {}
        self.current: int | None = None          # the last version a push committed
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)

    def check_name(self, reg: Registration) -> None:
        """Refuse a name a live member at another URL holds (409)."""
        now = time.monotonic()
        with self.lock:
            old = self.members.get(reg.name)
            if old is not None and old.state != "lapsed" and old.reg.url != reg.url:
                raise Conflict409(f"a member named {reg.name!r} is already registered at "
                                  f"{old.reg.url} (lease left {old.expires - now:.1f}s); pick "
                                  f"another name, or deregister it first")

    def register(self, reg: Registration) -> MemberState:
        now = time.monotonic()
        with self.lock:
            self.check_name(reg)
            m = MemberState(reg, now + self.lease, version=reg.version)
            self.members[reg.name] = m
            self.changed.notify_all()
            return m

    def heartbeat(self, name: str, version: int | None = None) -> MemberState:
        with self.lock:
            m = self.members.get(name)
            if m is None:
                raise HttpError(404, f"member {name!r} is not registered (the registry may have "
                                     f"restarted): register again")
            m.expires = time.monotonic() + self.lease
            if m.state == "lapsed":
                m.state, m.error = "live", None
            if version is not None:
                m.version = version
                self._caught_up(m)
            self.changed.notify_all()
            return m

    def _caught_up(self, m: MemberState) -> None:
        """A `behind` member that holds the fleet's version (a push reached it, or a pull that
        raced one) is live again; otherwise nothing would ever take it out of `behind`."""
        if m.state == "behind" and m.version is not None and self.current is not None \
                and m.version >= self.current:
            m.state, m.error = "live", None

    def deregister(self, name: str) -> None:
        with self.lock:
            if self.members.pop(name, None) is None:
                raise HttpError(404, f"member {name!r} is not registered")
            self.changed.notify_all()

    def expire(self) -> list[str]:
        """Members whose lease ran out become `lapsed`; returns their names."""
        now = time.monotonic()
        out = []
        with self.lock:
            for m in self.members.values():
                if m.state != "lapsed" and now > m.expires:
                    m.state, m.error = "lapsed", f"lease of {self.lease:g}s lapsed without a heartbeat"
                    out.append(m.reg.name)
        return out

    def set_state(self, name: str, state: State, error: str | None = None) -> None:
        with self.lock:
            m = self.members.get(name)
            if m is not None:
                m.state, m.error = state, error
                self._caught_up(m)
                self.changed.notify_all()

    def synced(self, version: int, versions: dict[str, int | None]) -> None:
        with self.lock:
            if any(v == version for v in versions.values()):
                self.current = max(self.current or 0, version)
            for name, v in versions.items():
                m = self.members.get(name)
                if m is not None and v is not None:
                    m.version = v
                    self._caught_up(m)
            self.changed.notify_all()

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            return {"version": self.current, "lease": self.lease,
                    "members": [m.view(now) for m in sorted(self.members.values(),
                                                            key=lambda m: m.reg.name)]}
