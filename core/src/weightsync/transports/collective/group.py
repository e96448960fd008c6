"""The trainer's group lifecycle for transport `collective`: build a group for exactly the
engines of a round (a fresh name per build, so a stale rank can never join), find who did not
join, rebuild without them, and leave it."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

from weightsync.errors import ConfigError, TransportError
from weightsync.interfaces import Adapter
from weightsync.interfaces.capabilities import group_ranks
from weightsync.transports.collective import pg as pgs
from weightsync.transports.collective.calls import _Call, _is_timeout, _spawn
from weightsync.transports.collective.messages import JoinGroup, LeaveGroup
from weightsync.transports.collective.options import LAYOUTS

log = logging.getLogger("weightsync.transports.collective")
_BUILDS = itertools.count(1)


class GroupLifecycle:
    """The group half of `CollectiveTransport` (which holds the attributes named here)."""

    options: Any
    backend: str
    group: pgs.Group | None
    infos: dict[str, dict[str, Any]]
    key: tuple | None
    _seq: int
    _members: dict[str, Adapter]
    bounded: Callable[[float], float]       # Transport's: a wait cut to the push's deadline

    @staticmethod
    def _layout(engines: Sequence[Adapter]) -> str:
        layouts = {a.layout for a in engines}
        if len(layouts) > 1:
            raise ConfigError(f"engines in one collective group must share a broadcast layout, got "
                              f"{sorted(layouts)}; run engines of different kinds in separate syncs")
        layout = next(iter(layouts), "safetensors")
        if layout not in LAYOUTS:
            raise ConfigError(f"adapter layout {layout!r} is unknown to transport 'collective'; "
                              f"known: {list(LAYOUTS)}")
        return layout

    def _destroy(self) -> None:
        if self.group is None:
            return
        for a in self._members.values():
            try:
                a.deliver(LeaveGroup(self.infos.get(a.engine_name, {})))
            except Exception as e:  # noqa: BLE001 - best effort by contract
                log.debug("engine %s did not leave group: %s", a.engine_name, e)
        g, self.group, self.key = self.group, None, None
        pgs.forget(g.pg)
        threading.Thread(target=pgs.shutdown, args=(g.pg,), daemon=True, name="ws-pg-destroy").start()

    def _build(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """A fresh group for `engines`; returns the engines that could not join."""
        self._destroy()
        o = self.options
        timeout = self.bounded(o.timeout)          # never past the push's deadline
        name = f"{o.group_name}_{next(_BUILDS)}"   # unique per process: a stale rank cannot join
        world = 1 + sum(group_ranks(a) for a in engines)
        store = pgs.make_store(o.master_address, o.master_port, world, True, timeout)
        port = store.port
        infos, offset = {}, 1
        for a in engines:
            infos[a.engine_name] = {"master_address": o.master_address, "master_port": port,
                                    "rank_offset": offset, "world_size": world,
                                    "group_name": name, "backend": self.backend}
            offset += group_ranks(a)
        calls = {a.engine_name: _spawn(a.deliver, JoinGroup(infos[a.engine_name])) for a in engines}
        try:
            pg = pgs.new_group(store, name, 0, world, self.backend, timeout)
        except Exception as e:  # noqa: BLE001 - turned into per-engine failures below
            return self._join_failures(engines, calls, infos, name, world, e, timeout)
        fails = {}
        for a in engines:
            c = calls[a.engine_name]
            if not c.done(self.bounded(o.timeout)) or c.error:
                fails[a.engine_name] = c.error[0] if c.error else TransportError(
                    f"engine did not confirm joining group {name!r} within {timeout:.0f}s")
        self.group = pgs.Group(name, pg, store, 0, world, self.backend)
        self._seq = 0
        self.infos = infos
        self._members = {a.engine_name: a for a in engines}
        self.key = tuple((a.engine_name, group_ranks(a)) for a in engines)
        if fails:   # a member that did not confirm poisons the group: rebuild without it next time
            self.key = None
        return fails

    def _join_failures(self, engines: Sequence[Adapter], calls: dict[str, _Call],
                       infos: dict[str, dict[str, Any]], name: str, world: int,
                       err: BaseException, timeout: float) -> dict[str, BaseException]:
        """Rank 0 gave up on the group: the culprits are the calls still running after a grace
        period (the others fail right after it); failing that, those that failed on their own."""
        deadline = time.monotonic() + self.bounded(max(1.0, min(10.0, timeout)))
        pending = [a for a in engines if not calls[a.engine_name].done(max(0.0, deadline - time.monotonic()))]
        log.info("group %r was not formed: %s", name, err)
        if pending:
            return {a.engine_name: TransportError(
                f"engine did not join collective group {name!r} within {timeout:.0f}s "
                f"(rank {infos[a.engine_name]['rank_offset']} of {world}); it was left out "
                f"(rank 0: {str(err).splitlines()[0][:200]})")
                for a in pending}
        errs = {a.engine_name: calls[a.engine_name].error[0] for a in engines
                if calls[a.engine_name].error and not _is_timeout(calls[a.engine_name].error[0])}
        return errs or {a.engine_name: TransportError(f"group {name!r} could not be formed: {err}")
                        for a in engines}

    def _ensure(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """The group for exactly `engines`, rebuilt (once more without those that cannot join)."""
        key = tuple((a.engine_name, group_ranks(a)) for a in engines)
        if self.group is not None and self.key == key:
            return {}
        failures: dict[str, BaseException] = {}
        members = list(engines)
        for _ in range(2):
            fails = self._build(members)
            failures.update(fails)
            members = [a for a in members if a.engine_name not in fails]
            if not fails or not members:
                break
        if failures and members and self.key is None:
            self._destroy()
        return failures
