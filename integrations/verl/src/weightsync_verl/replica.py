"""The rollout side: each rollout worker's checkpoint engine runs a weightsync engine (the
reference engine's receiver, weights only) that the trainer's `WeightSync` pushes into, with
weightsync's own protocol (begin, payloads through the configured transport, digests checked
before commit, commit). The worker registers it with the trainer's fleet registry; verl's
`receive_weights` then hands the committed version to verl's server adapter.

The engine's store is laid out from the trainer's names, shapes and dtypes (the trainer's
`layout`), so the first round of a replica also fixes what every later round must match."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from weightsync.fleets.client import RegistryClient
from weightsync.fleets.member import Membership
from weightsync.plugins import load_components
from weightsync.receive import DictStore
from weightsync.wire.bucket import dtype_name

log = logging.getLogger("weightsync.verl")
Layout = list[list[Any]]            # [[name, dtype name, shape], ...] in the trainer's order


def layout_of(named: dict[str, torch.Tensor]) -> Layout:
    return [[n, dtype_name(t.dtype), list(t.shape)] for n, t in named.items()]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"the trainer's layout names dtype {name!r}, which torch does not have")
    return dt


class Replica:
    """One rollout worker's engine, its HTTP server and its fleet membership."""

    def __init__(self, master: dict[str, Any], layout: Layout, name: str, *,
                 host: str = "127.0.0.1", advertise: str | None = None) -> None:
        from weightsync_reference.server import ReferenceEngine, make_server
        from weightsync_reference.server.model import LoadedModel
        for k in ("registry", "key"):
            if not master.get(k):
                raise ValueError(f"the trainer's checkpoint-engine metadata has no {k!r}: is the "
                                 f"trainer also using the weightsync backend?")
        self.master, self.name = dict(master), name
        store = DictStore({n: torch.zeros(shape, dtype=_dtype(dt)) for n, dt, shape in layout})
        self.layout = [list(x) for x in layout]
        self.engine = ReferenceEngine(LoadedModel(store, None, "weights-only"), load_components(),
                                      name=name)
        self.aborted: dict[int, str] = {}          # version -> why its round was dropped here
        self._watch_aborts()
        self.key = os.urandom(18).hex()            # the engine's key: the trainer reads it from
        self.server = make_server(self.engine, host, 0, api_key=self.key)    # the registry
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="ws-verl-engine", daemon=True).start()
        where = advertise or ("127.0.0.1" if host in ("0.0.0.0", "") else host)
        self.url = f"http://{where}:{self.server.server_address[1]}"
        self.registry = RegistryClient(master["registry"], master["key"])
        self.membership = Membership(master["registry"], master["key"],
                                     {"name": name, "url": self.url, "role": "engine",
                                      "adapter": {"kind": "reference"}, "api_key": self.key},
                                     version=lambda: self.engine.version)
        self.engine.membership = self.membership
        try:
            self.membership.start()                 # registers now: the push that follows sees it
        except BaseException:
            self._stop_server()
            raise
        self._left = False

    def _watch_aborts(self) -> None:
        """Record rounds the trainer aborted on this engine (a digest that did not match, a
        broken transfer): `wait` then fails at once instead of waiting out its deadline."""
        engine, original = self.engine, type(self.engine).abort

        def abort(rid: str | None) -> None:
            r = engine.round
            original(engine, rid)
            if r is not None and engine.round is None:
                self.aborted[r.version] = "the trainer aborted this replica's round"
                with engine.state:
                    engine.state.notify_all()
        engine.abort = abort  # type: ignore[method-assign]  # this engine's own instance

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def wait(self, version: int, deadline: float) -> None:
        """Until this engine committed `version`. Fails at once when the trainer aborted the
        round here, or when the registry records a push of `version` (or newer) that did not
        reach this engine; otherwise at `deadline` seconds."""
        end, poll = time.monotonic() + deadline, 0.0
        while True:
            with self.engine.state:
                self.engine.state.wait_for(lambda: self.engine.version >= version
                                           or version in self.aborted, timeout=0.5)
            if self.engine.version >= version:
                return
            if version in self.aborted:
                raise RuntimeError(f"replica {self.name}: version {version} did not arrive: "
                                   f"{self.aborted[version]} (see the trainer's round report)")
            if time.monotonic() >= poll:
                poll = time.monotonic() + 2.0
                fleet = self.registry.fleet()
                if int(fleet.get("version") or 0) >= version:
                    me: dict[str, Any] = next((m for m in fleet["members"]
                                               if m["name"] == self.name), {})
                    raise RuntimeError(f"replica {self.name}: the trainer pushed version "
                                       f"{fleet['version']} without it reaching this replica "
                                       f"(which holds {self.version}; registry says: "
                                       f"{me.get('state', 'not a member')}, {me.get('error')})")
            if time.monotonic() >= end:
                raise TimeoutError(f"replica {self.name}: version {version} did not arrive within "
                                   f"{deadline:g}s (it holds {self.version})")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The committed version, in the trainer's order (the store's tensors: the next commit
        replaces them only in the next round, after verl's adapter has loaded these)."""
        store = self.engine.model.store
        for n, _, _ in self.layout:
            t = store.get(n)
            assert t is not None, n
            yield n, t

    def leave(self) -> None:
        """Deregister (idempotent): no push reaches this engine any more."""
        if not self._left:
            self._left = True
            self.membership.stop()

    def _stop_server(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.close()

    def close(self) -> None:
        self.leave()
        self._stop_server()
