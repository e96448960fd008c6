"""The trainer side: the actor's rank 0 holds a `WeightSync` whose fleet is a registry the rollout
workers' engines register with, narrowed each round to the workers in verl's topology. A push is
weightsync's whole round (its transport, relay shapes, encoding, digests before commit, the
round report); the layout (names, dtypes, shapes) reaches replicas that start before anything was
pushed through a small long-poll endpoint, JSON only."""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import Any

import torch
from weightsync import SyncError, SyncReport, WeightSync
from weightsync.fleets.registry import RegistryFleet
from weightsync.interfaces import Member
from weightsync.net.server import HttpError, Routes, Server, make_server
from weightsync.plugins import load_components

from .replica import Layout, layout_of

log = logging.getLogger("weightsync.verl")
routes = Routes()
TOKEN_HEADER = "X-Weightsync-Verl-Token"
NO_PROBE = ("verl's rollout replicas take weights through verl's server adapter (CUDA IPC into "
            "vLLM or SGLang), which offers no call that scores a sequence, and the weightsync "
            "engine in each checkpoint-engine worker holds the bytes but runs no model")


class TopologyFleet(RegistryFleet):
    """The registry, narrowed to this round's topology: a member verl removed (or that died
    and was removed) is not pushed to even while its lease runs; a worker of the topology that
    is not a live member is reported absent, never waited for."""

    name = "verl_topology"

    def __init__(self, options: Any = None, engines: list[Any] | None = None) -> None:
        super().__init__(options, engines)
        self.round: list[str] | None = None       # this round's rollout workers (None: all)
        self.absent: list[str] = []

    def members(self) -> list[Member]:
        live = super().members()
        return live if self.round is None else [m for m in live if m.name in set(self.round)]

    def excluded(self) -> dict[str, str]:
        """What the push leaves out (the pipeline asks once per push, before `members`); the
        topology's workers that are no live member are kept in `absent` for verl's metrics."""
        out = dict(super().excluded())
        if self.round is not None:
            names = {m.name for m in super().members()}
            for n in sorted(names - set(self.round)):
                out[n] = "not in verl's topology this round (removed from the manager)"
            self.absent = [n for n in self.round if n not in names]
            for n in self.absent:
                out.setdefault(n, "in verl's topology but not a live member of the fleet")
        return out


class Trainer:
    """Rank 0's WeightSync, its registry and the layout endpoint."""

    def __init__(self, *, host: str, port: int, advertise: str | None, lease: float,
                 deadline: float, bucket_bytes: int, config: Mapping[str, Any] | None) -> None:
        self.key = secrets.token_urlsafe(24)          # the fleet key: replicas register with it
        self.token = secrets.token_urlsafe(24)        # the layout endpoint's
        components = load_components()
        components.fleets.add(TopologyFleet)
        user = dict(config or {})
        for k in ("fleet", "engines", "adapter", "exporter"):
            if k in user:
                raise ValueError(f"engine_kwargs.weightsync.config.{k} is set by the verl backend "
                                 f"(the fleet is verl's rollout workers); leave it out")
        sync = dict(user.pop("sync", None) or {})
        sync.setdefault("deadline", deadline)
        sync.setdefault("progress", "off")
        sync["probe"] = {"mode": "off"}               # nothing here can score: see NO_PROBE
        self.sync = WeightSync.from_config({
            **user, "sync": sync, "adapter": "reference",
            "exporter": {"kind": "torch", "options": {"bucket_bytes": int(bucket_bytes)}},
            "fleet": {"kind": "verl_topology", "options": {
                "host": host, "port": port, "api_key": self.key, "lease": lease,
                "peer_join": False}}}, components=components)
        self.fleet: TopologyFleet = self.sync.fleet    # type: ignore[assignment]
        self.layout: Layout | None = None
        self.changed = threading.Condition()
        self.server: Server = make_server(routes, host, 0, api_key=None, name="verl layout",
                                          state={"trainer": self})
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="ws-verl-layout", daemon=True).start()
        where = advertise or ("127.0.0.1" if host in ("0.0.0.0", "") else host)
        self.url = f"http://{where}:{self.server.server_address[1]}"
        registry = str(self.sync.fleet_url)
        self.registry_url = (f"http://{advertise}:{registry.rsplit(':', 1)[1]}" if advertise
                             else registry)
        self.last: SyncReport | None = None

    def metadata(self) -> dict[str, Any]:
        """What every replica needs (it travels through verl's own topology exchange)."""
        return {"url": self.url, "token": self.token, "registry": self.registry_url,
                "key": self.key, "layout": self.layout, "version": self.sync.last_version or 0}

    def await_layout(self, token: str | None, timeout: float) -> Layout | None:
        if not token or not hmac.compare_digest(token.encode(), self.token.encode()):
            raise HttpError(401, "missing or wrong token: take it from the actor's topology")
        with self.changed:
            self.changed.wait_for(lambda: self.layout is not None, timeout=max(0.0, timeout))
            return self.layout

    def push(self, named: dict[str, torch.Tensor], version: int, topology: list[str],
             starting: list[str], deadline: float) -> SyncReport:
        """One round: the layout first (replicas that start in this round wait for it), then
        WeightSync's push to this round's members. `starting`: the topology's workers whose
        engine starts in this round (they had no layout yet); only those are waited for to
        register, at most `deadline` seconds. Any other worker of the topology that is not a
        live member is reported absent at once."""
        layout = layout_of(named)
        if self.layout is not None and layout != self.layout:
            raise ValueError("the actor's tensors (names, dtypes or shapes) changed between "
                             "rounds; the rollout replicas' engines are laid out once")
        with self.changed:
            self.layout = layout
            self.changed.notify_all()
        if starting:
            self._await_registration(starting, deadline)
        self.fleet.round = list(topology)
        try:
            report = self.sync.push(named, version=version)
        except SyncError as e:
            if not isinstance(e.report, SyncReport):
                raise
            report = e.report
        report.probe = f"skipped: {NO_PROBE}"
        self.last = report
        return report

    def _await_registration(self, starting: list[str], timeout: float) -> None:
        """Replicas whose engine starts in this round register once they have the layout; this
        waits for those (alive: verl just ran init_process_group on them), bounded."""
        roster = self.fleet.service.roster
        names = set(starting)
        with roster.changed:
            roster.changed.wait_for(lambda: names <= set(roster.members), timeout=timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.sync.close()


@routes.add("GET", "/weightsync/verl/layout", auth=False, max_body=0)
def _layout(h: Any, q: dict) -> Any:
    try:
        timeout = min(float(q.get("timeout", ["30"])[0]), 300.0)
    except ValueError:
        raise HttpError(400, "verl/layout takes ?timeout=s") from None
    return {"layout": h.trainer.await_layout(h.headers.get(TOKEN_HEADER), timeout)}
