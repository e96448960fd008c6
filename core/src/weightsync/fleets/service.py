"""The fleet registry service: members register, heartbeat and deregister over HTTP; a member
behind the fleet catches up from a peer before it takes part in pushes. Runs inside the trainer
(`fleet: {kind: registry}`) or on its own (`weightsync fleet serve`).

  POST /fleet/register    Registration JSON (+ "credential" to register a held name again)
                          -> {"lease": s, "version": current, "member": {...}, "credential": c}
  POST /fleet/heartbeat   {"name": n, "credential": c, "version": v?} -> the member's view
  POST /fleet/deregister  {"name": n, "credential": c}
  GET  /fleet             {"version": current, "lease": s, "members": [...]}; ?with_keys=1: with
                          registrations (trainer key); ?rollouts=1: URL, adapter kind and rollout
                          key per engine (router key, X-Weightsync-Router, or trainer key)
  POST /fleet/synced      {"version": v, "versions": {name: v}, "anchor": [[names], digest]...}

Every route needs the fleet key, which lets a process register *itself*: later calls about a
member carry the credential it got back. Only the trainer key (X-Weightsync-Trainer) reads the
engine keys or reports a push; the router key reads the rollout keys and nothing else."""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from weightsync.config import ComponentRef, build_options
from weightsync.errors import PluginError, WeightSyncError
from weightsync.net.server import HttpError, Routes, Server, make_server
from weightsync.interfaces import Adapter, Member
from weightsync.fleets.catchup import CatchUp
from weightsync.fleets.roster import MemberState, Registration, Roster

__all__ = ["RegistryService", "routes"]

log = logging.getLogger("weightsync.fleets")
routes = Routes()


class RegistryService:
    def __init__(self, components: Any, *, lease: float = 10.0, api_key: str | None = None,
                 peer_join: bool = True, health_check: bool = True,
                 default_adapter: ComponentRef | None = None, peer_ttl: float = 600.0,
                 trainer_key: str | None = None, state_file: str | None = None,
                 router_key: str | None = None) -> None:
        self.components, self.roster, self.api_key = components, Roster(lease), api_key
        self.trainer_key = trainer_key           # reads engine keys, reports pushes
        self.router_key = router_key             # reads rollout keys (generation only)
        self.anchors: dict[int, list[Any]] = {}  # version -> the trainer's [[names], digest]s
        self.state_file = Path(state_file) if state_file else None
        self.health_check = health_check
        self.default_adapter = default_adapter or ComponentRef(kind="reference")
        self.adapters: dict[str, tuple[tuple, Adapter]] = {}
        self.lock = threading.Lock()
        self.catchup = CatchUp(self, enabled=peer_join, ttl=peer_ttl)
        self.server: Server | None = None
        self.url: str | None = None
        self._load_state()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.server = make_server(routes, host, port, api_key=self.api_key, name="fleet registry",
                                  state={"service": self})
        real = self.server.server_address[1]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{real}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="ws-registry", daemon=True).start()
        self.catchup.start()
        log.info("fleet registry serving on %s (lease %.1fs)", self.url, self.roster.lease)
        return self.url

    def close(self) -> None:
        self.catchup.stop()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        for _, a in self.adapters.values():
            a.close()

    # -- members ------------------------------------------------------------------------------
    def adapter(self, m: MemberState) -> Adapter:
        """The adapter that speaks to member `m` (built once per registration)."""
        key = (m.reg.url, m.reg.adapter.model_dump_json(), repr(sorted(m.reg.options.items())),
               m.reg.api_key)
        with self.lock:
            hit = self.adapters.get(m.reg.name)
            if hit is not None and hit[0] == key:
                return hit[1]
            cls = self.components.adapters.get(m.reg.adapter.kind)
            a = cls(build_options(cls, m.reg.adapter, "adapter", m.reg.options), m.reg.spec())
            if hit is not None:
                hit[1].close()
            self.adapters[m.reg.name] = (key, a)
            return a

    def set_anchor(self, version: int, buckets: Any, save: bool = True) -> None:
        """The trainer's digests for `version` (per bucket: names, digest); the last few kept."""
        if not isinstance(buckets, list) or not all(
                isinstance(b, (list, tuple)) and len(b) == 2 and isinstance(b[0], list)
                and all(isinstance(n, str) for n in b[0]) and isinstance(b[1], str)
                for b in buckets):
            raise HttpError(400, "anchor must be a list of [[tensor names], digest] per bucket")
        with self.lock:
            self.anchors[int(version)] = [[list(b[0]), b[1]] for b in buckets]
            for old in sorted(self.anchors)[:-4]:
                del self.anchors[old]
        if save:
            self._save_state()

    # -- what outlives a restart: the fleet's version and the trainer's digests ---------------
    def _load_state(self) -> None:
        """The fleet's version, digests and name bindings from `state_file` (not the roster)."""
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            raw = json.loads(self.state_file.read_text())
            version = raw.get("version")
            anchors = {int(k): v for k, v in (raw.get("anchors") or {}).items()}
            bindings = {str(k): str(v) for k, v in (raw.get("bindings") or {}).items()}
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise WeightSyncError(f"fleet state file {self.state_file} is unreadable ({e}); "
                                  f"move it away to start with an empty fleet") from None
        self.roster.current = int(version) if isinstance(version, int) else None
        self.roster.bind(bindings)
        for v, buckets in anchors.items():
            self.set_anchor(v, buckets, save=False)
        log.info("fleet state from %s: version %s", self.state_file, self.roster.current)

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        with self.lock:
            with self.roster.lock:
                bindings = dict(self.roster.bindings)
            data = {"version": self.roster.current, "bindings": bindings,
                    "anchors": {str(k): v for k, v in self.anchors.items()}}
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.state_file)

    def synced(self, version: int, versions: dict[str, int | None],
               anchor: list[Any] | None = None) -> None:
        """What a push did (and its digests, for peer joins); kept on disk with `state_file`."""
        if anchor is not None:
            self.set_anchor(version, anchor, save=False)
        self.roster.synced(version, versions)
        self._save_state()
        self.catchup.poke()

    def is_trainer(self, got: str | None, key: str | None = None) -> bool:
        """`got` is the trainer key (or `key`, when given: the router key)."""
        want = key if key is not None else self.trainer_key
        return bool(want) and isinstance(got, str) and hmac.compare_digest(
            got.encode("utf-8", "surrogateescape"), str(want).encode())

    def register(self, raw: Any, *, credential: str | None = None) -> dict[str, Any]:
        try:
            reg = Registration.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            raise HttpError(400, f"bad registration: {'.'.join(map(str, err['loc']))}: "
                                 f"{err['msg']}") from None
        try:
            reg.spec()                   # the url must look like http://host:port
            if reg.role == "engine":     # a host (a disk puller) is shown, never pushed to
                cls = self.components.adapters.get(reg.adapter.kind)
                build_options(cls, reg.adapter, "adapter", reg.options)
        except (PluginError, WeightSyncError, ValueError) as e:
            raise HttpError(400, f"registration of {reg.name!r} refused: {e}") from None
        self.roster.check_name(reg, credential)
        if self.health_check and reg.role == "engine":
            probe = cls(build_options(cls, reg.adapter, "adapter", reg.options), reg.spec())
            probe.deadline = None
            try:
                status = probe.health()
            except Exception as e:  # noqa: BLE001 - said back to the member
                raise HttpError(400, f"registration of {reg.name!r} refused: its engine at "
                                     f"{reg.url} cannot be reached: {e}") from None
            finally:
                probe.close()
            if reg.version is None:
                reg = reg.model_copy(update={"version": status.version})
        bound = self.roster.bindings.get(reg.name)
        m = self.roster.register(reg, credential)
        if self.roster.bindings.get(reg.name) != bound:
            self._save_state()       # a new binding outlives this process (a member back is not)
        self.catchup.failed.pop(reg.name, None)     # a new registration gets a fresh try
        self.catchup.poke()
        log.info("member %s registered at %s (%s, version %s)", reg.name, reg.url,
                 reg.adapter.kind, m.version)
        return {"lease": self.roster.lease, "version": self.roster.current,
                "member": m.view(0.0), "credential": m.credential}

    def members(self) -> list[Member]:
        """Members a push starting now must reach: engines, live or behind, lease valid."""
        self.roster.expire()
        with self.roster.lock:
            return [Member(m.reg.name, m.reg.spec(), m.version, {"state": m.state})
                    for m in self.roster.members.values()
                    if m.reg.role == "engine" and m.state in ("live", "behind")
                    and not self.catchup.due(m)]

    def excluded(self) -> dict[str, str]:
        self.roster.expire()
        with self.roster.lock:
            out = {}
            for m in self.roster.members.values():
                if m.reg.role != "engine":
                    continue
                if m.state == "joining":
                    out[m.reg.name] = f"catching up from peer {m.via or '?'}"
                elif self.catchup.due(m):
                    out[m.reg.name] = "behind the fleet: a peer join for it is starting"
                elif m.state == "lapsed":
                    out[m.reg.name] = m.error or "lease lapsed"
            return out


# -- routes -----------------------------------------------------------------------------------
@routes.add("POST", "/fleet/register", max_body=256 * 1024)
def _register(h: Any, q: dict) -> Any:
    body = _object(h)
    return h.service.register(body, credential=body.pop("credential", None))


def _object(h: Any) -> dict[str, Any]:
    body = h.json_body()
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body


def _trainer_only(h: Any, what: str) -> None:
    if not h.service.is_trainer(h.headers.get("X-Weightsync-Trainer")):
        raise HttpError(403, f"{what} is for the trainer only: send the registry's trainer key "
                             f"in X-Weightsync-Trainer (`weightsync fleet serve "
                             f"--trainer-key-file`, the fleet option trainer_key_file)")


@routes.add("POST", "/fleet/heartbeat", max_body=64 * 1024)
def _heartbeat(h: Any, q: dict) -> Any:
    body = _object(h)
    v = body.get("version")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise HttpError(400, f"version must be a non-negative integer, got {v!r}")
    m = h.service.roster.heartbeat(str(body.get("name", "")), v, body.get("credential"), check=True)
    h.service.catchup.poke()
    return m.view(0.0) | {"lease": h.service.roster.lease}


@routes.add("POST", "/fleet/deregister", max_body=64 * 1024)
def _deregister(h: Any, q: dict) -> Any:
    body = _object(h)
    name = str(body.get("name", ""))
    h.service.roster.deregister(name, body.get("credential"), check=True)
    h.service._save_state()
    log.info("member %s deregistered", name)
    return {"ok": True}


@routes.add("GET", "/health", auth=False, max_body=0)
def _health(h: Any, q: dict) -> Any:
    """Up and serving (no key needed, nothing about the members): for a supervisor's probe."""
    return {"status": "ok"}


@routes.add("GET", "/fleet", max_body=0)
def _fleet(h: Any, q: dict) -> Any:
    view = h.service.roster.view()
    if q.get("rollouts", ["0"])[0] == "1":
        return _rollouts(h, view)
    if q.get("with_keys", ["0"])[0] == "1":
        _trainer_only(h, "reading the members' engine keys")
        regs = _registrations(h.service)
        for m in view["members"]:
            r = regs.get(m["name"])
            if r is not None:
                m["registration"] = r.model_dump(mode="json")
    return view


def _registrations(svc: RegistryService) -> dict[str, Registration]:
    with svc.roster.lock:
        return {m.reg.name: m.reg for m in svc.roster.members.values()}


def _rollouts(h: Any, view: dict[str, Any]) -> Any:
    """Each engine member's URL, adapter kind and rollout key, for a router (never its engine
    key); members with an engine key but no rollout key are left out."""
    svc = h.service
    if not (svc.is_trainer(h.headers.get("X-Weightsync-Trainer"))
            or svc.is_trainer(h.headers.get("X-Weightsync-Router"), svc.router_key or "")):
        raise HttpError(403, "the members' rollout keys are for the router: send the registry's "
                             "router key in X-Weightsync-Router (`weightsync fleet serve "
                             "--router-key-file`, the fleet option router_key_file)")
    regs = _registrations(svc)
    out = []
    for m in view["members"]:
        r = regs.get(m["name"])
        if r is not None and m["role"] == "engine" and (r.rollout_key or not r.api_key):
            out.append({**m, "rollout": {"url": r.url, "adapter": r.adapter.kind,
                                         "api_key": r.rollout_key}})
    return {**view, "members": out}


@routes.add("POST", "/fleet/synced", max_body=16 * 2**20)
def _synced(h: Any, q: dict) -> Any:
    _trainer_only(h, "reporting a push")
    body = _object(h)
    versions = body.get("versions") or {}
    if not isinstance(versions, dict):
        raise HttpError(400, "versions must map member names to versions")
    h.service.synced(int(body["version"]), {str(k): (None if v is None else int(v))
                                            for k, v in versions.items()}, body.get("anchor"))
    return {"ok": True}
