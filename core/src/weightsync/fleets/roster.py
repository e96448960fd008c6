"""The registry's state: members, leases, versions and states, rebuilt from registrations when the
registry restarts. Every registration gets a credential of its own: later calls name the member
*and* carry it, so the fleet key lets a process register itself, never act as another member. A
name stays bound to its credential's SHA-256 (kept in the state file) until the member deregisters
or is silent for `RELEASE_LEASES` leases. States: `live` (in every push), `joining` (catching up
from a peer), `behind` (the next push sends it whole tensors), `lapsed` (lease ran out)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from weightsync.config import ComponentRef, EngineSpec
from weightsync.net.server import Conflict409, HttpError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$")
RELEASE_LEASES = 10   # silent leases after which another member may take a name


def credential_hash(credential: str) -> str:
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()
State = Literal["live", "joining", "behind", "lapsed"]


class Registration(BaseModel):
    """What a member sends to register (JSON)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    url: str
    adapter: ComponentRef = ComponentRef(kind="reference")
    options: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None
    rollout_key: str | None = None     # opens the engine's generation routes only (a router's)
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
    credential: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def owns(self, credential: str | None) -> bool:
        return isinstance(credential, str) and hmac.compare_digest(
            credential.encode("utf-8", "surrogateescape"), self.credential.encode())

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
        self.bindings: dict[str, str] = {}        # name -> credential_hash of its member's credential
        self.heard: dict[str, float] = {}         # name -> when its member was last heard from
        self.release_after = RELEASE_LEASES * lease
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)

    def bind(self, hashes: dict[str, str]) -> None:
        """Bindings kept across a restart: each name's release counts from now."""
        with self.lock:
            now = time.monotonic()
            for name, h in hashes.items():
                self.bindings[name], self.heard[name] = h, now

    def _bound_to(self, name: str, credential: str | None) -> bool:
        h = self.bindings.get(name)
        return h is not None and isinstance(credential, str) and hmac.compare_digest(
            credential_hash(credential), h)

    def check_name(self, reg: Registration, credential: str | None = None) -> None:
        """Refuse (409) a name a live member holds, or one bound to another credential heard from
        within `release_after` seconds, unless `credential` is that member's own."""
        now = time.monotonic()
        with self.lock:
            self.expire()
            old = self.members.get(reg.name)
            if old is not None and old.state != "lapsed" and not old.owns(credential):
                raise Conflict409(f"a member named {reg.name!r} is already registered at "
                                  f"{old.reg.url} (lease left {old.expires - now:.1f}s); pick "
                                  f"another name, or wait until it deregisters or its lease "
                                  f"lapses")
            left = self.heard.get(reg.name, now) + self.release_after - now
            if reg.name in self.bindings and not self._bound_to(reg.name, credential) \
                    and not (old is not None and old.owns(credential)) and left > 0:
                raise Conflict409(f"the name {reg.name!r} belongs to another member's credential "
                                  f"(kept across lapses and registry restarts): register with "
                                  f"that credential, or pick another name; it is released "
                                  f"{left:.0f}s from now unless its member is heard from")

    def _member(self, name: str, credential: str | None, check: bool) -> MemberState:
        m = self.members.get(name)
        if m is None:
            raise HttpError(404, f"member {name!r} is not registered (the registry may have "
                                 f"restarted): register again")
        if check and not m.owns(credential):
            raise HttpError(403, f"member {name!r} is registered with another credential: only "
                                 f"the member that registered a name may heartbeat, update or "
                                 f"deregister it (send the credential /fleet/register returned)")
        return m

    def register(self, reg: Registration, credential: str | None = None) -> MemberState:
        now = time.monotonic()
        with self.lock:
            self.check_name(reg, credential)
            m = MemberState(reg, now + self.lease, version=reg.version)
            old = self.members.get(reg.name)
            if credential is not None and ((old is not None and old.owns(credential))
                                           or self._bound_to(reg.name, credential)):
                m.credential = credential            # the same member, back (a restart)
            self.members[reg.name] = m
            self.bindings[reg.name] = credential_hash(m.credential)
            self.heard[reg.name] = now
            self.changed.notify_all()
            return m

    def heartbeat(self, name: str, version: int | None = None, credential: str | None = None,
                  check: bool = False) -> MemberState:
        """`check`: the caller came over the network, so `credential` must be the member's."""
        with self.lock:
            m = self._member(name, credential, check)
            now = time.monotonic()
            m.expires, self.heard[name] = now + self.lease, now
            if m.state == "lapsed":
                m.state, m.error = "live", None
            if version is not None:
                m.version = version
                self._caught_up(m)
            self.changed.notify_all()
            return m

    def _caught_up(self, m: MemberState) -> None:
        """A `behind` member that holds the fleet's version is live again."""
        if m.state == "behind" and m.version is not None and self.current is not None \
                and m.version >= self.current:
            m.state, m.error = "live", None

    def deregister(self, name: str, credential: str | None = None, check: bool = False) -> None:
        with self.lock:
            self._member(name, credential, check)
            del self.members[name]
            self.bindings.pop(name, None)
            self.heard.pop(name, None)
            self.changed.notify_all()

    def expire(self) -> None:
        """Members whose lease ran out become `lapsed`."""
        now = time.monotonic()
        with self.lock:
            for m in self.members.values():
                if m.state != "lapsed" and now > m.expires:
                    m.state, m.error = "lapsed", f"lease of {self.lease:g}s lapsed without a heartbeat"

    def set_state(self, name: str, state: State, error: str | None = None) -> None:
        with self.lock:
            m = self.members.get(name)
            if m is not None:
                m.state, m.error = state, error
                self._caught_up(m)
                self.changed.notify_all()

    def synced(self, version: int, versions: dict[str, int | None]) -> None:
        with self.lock:
            if not versions or any(v == version for v in versions.values()):   # none: published
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
