"""The pull agent of a rollout host: follow `latest`, bring the host-local checkpoint to it, then
have the engine reload from that checkpoint through its adapter.

Nothing read from the shared root is trusted: the whole way to `latest` (plan.py) is checked
before the local checkpoint is touched, shards are read only as regular files under the root and
of the size the manifest says, and their arrays are checked against the local tensors before a
journal is written. The checkpoint only ever moves forward, from one whole version to a newer
whole version; a failure leaves it where it was (or at the last whole version the chain reached),
and in loop mode the agent reports it, backs off and tries again.

Several agents on one host share one local checkpoint: the exclusive lock makes one apply while
the others wait and then find it already current."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from weightsync.errors import PayloadError, WeightSyncError
from weightsync.interfaces import Adapter, ReloadsFromDisk

from . import kernels, shards
from .layout import Hook, read_latest
from .local import Build, LocalCheckpoint, Undone
from .plan import ChainBroken, LocalAhead, Plan, Planner, PlanError
from .prepare import delta_changes, full_digests
from .schema import Manifest

__all__ = ["Agent", "ChainBroken", "LocalAhead", "PlanError"]

log = logging.getLogger("weightsync.disk_delta.agent")

ADVICE = ("the agent tries again after backing off; if this persists, have the trainer publish "
          "a newer version (a full one if the chain is damaged)")


def _cannot_reload(adapter: object) -> WeightSyncError:
    return WeightSyncError(f"adapter {type(adapter).__name__} cannot reload from disk (it has no "
                           f"`load_from_disk`: the ReloadsFromDisk capability)")


class Agent:
    def __init__(self, root: str | Path, local: str | Path, adapter: Adapter | None = None, *,
                 before_read: Hook | None = None, fsync: bool = False,
                 on_event: Callable[[str], None] | None = None, max_backoff: float = 60.0,
                 hmac_key: bytes | None = None) -> None:
        if adapter is not None and not isinstance(adapter, ReloadsFromDisk):
            raise _cannot_reload(adapter)           # before any round, not at its first reload
        self.root = Path(root)
        self.hmac_key = hmac_key                 # manifests must be signed with it
        self.local = LocalCheckpoint(local, fsync=fsync)
        self.adapter = adapter
        self.before_read = before_read
        self.max_backoff = max_backoff
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        # the fleet's version (a registry's view): a `latest` below it is a stale or rolled-back
        # root, which a signature does not reveal (an old version stays validly signed)
        self.floor: Callable[[], int | None] = lambda: None
        kernels.warm()             # compiled (or loaded from numba's cache) before the first delta

    # -- the local checkpoint ---------------------------------------------------------------
    def sync_local(self, target: int | None = None) -> int | None:
        """Bring the local checkpoint to `latest` (or to `target` when lower); returns its
        version (None: nothing published yet). Never moves it to an older version."""
        latest = read_latest(self.root, self.before_read)
        floor = self.floor()
        if latest is not None and floor is not None and latest < floor:
            raise PlanError(f"{self.root / 'latest'} points at version {latest}, older than version "
                            f"{floor} the fleet registry reports: the shared root is stale or was "
                            f"rolled back (its signature cannot tell), so nothing was loaded")
        if latest is not None and target is not None:
            latest = min(latest, target)
        with self.local.locked(exclusive=True):
            cur = self.local.version
            if latest is None or cur == latest:
                return cur
            if cur is not None and cur > latest:
                if target is not None and latest == target:
                    return cur                      # asked for less than it holds: done
                raise LocalAhead(
                    f"the local checkpoint {self.local.path} holds version {cur}, newer than "
                    f"version {latest} that {self.root / 'latest'} points at; a host is never moved "
                    f"back, so nothing was changed. If the trainer really started over, remove "
                    f"{self.local.path} (or publish a version above {cur})")
            self.on_event(f"local {cur} -> latest {latest}")
            planner = Planner(self.root, self.before_read, self.hmac_key)
            try:
                plan = planner.plan(self.local.state(), latest, self.on_event)
            except PayloadError as e:
                raise PlanError(f"{e}; the local checkpoint stays at "
                                f"{self._where(cur)}; {ADVICE}") from None
            try:
                self._run(plan)
            except Undone as e:
                if cur is None or self.local.version is not None:
                    raise Undone(f"{e}; {ADVICE}") from None
                self.on_event(f"falling back to the newest full version: {e}")   # discarded
                self._rebuild(planner, latest)
            except PayloadError as e:
                raise type(e)(f"{e}; the local checkpoint is at {self._where(self.local.version)}; "
                              f"{ADVICE}") from None
            except OSError as e:     # the host's own disk (full, read-only): nothing half-made stays
                raise WeightSyncError(f"writing the local checkpoint {self.local.path} failed: {e}; "
                                      f"it is at {self._where(self.local.version)}; free space "
                                      f"there or point --local elsewhere") from None
            return self.local.version

    @staticmethod
    def _where(v: int | None) -> str:
        return "no version yet" if v is None else f"version {v}"

    def _rebuild(self, planner: Planner, latest: int) -> None:
        try:
            self._run(planner.plan(None, latest, self.on_event))
        except PayloadError as e:
            raise type(e)(f"{e}; the local checkpoint holds no version now; {ADVICE}") from None

    def _run(self, plan: Plan) -> None:
        """Carry out a checked plan: deltas in place, or a full version and its deltas built
        aside and swapped in at once."""
        if plan.full is None:
            Planner(self.root, self.before_read, self.hmac_key).check_contents(plan.deltas[1:])
            for m in plan.deltas:
                self._apply_delta(m)
            return
        build = self._build_full(plan.full)
        try:
            for m in plan.deltas:
                _, arrays = shards.load(self.root, m, self.before_read)
                changes = delta_changes(m, arrays, build.tensors,
                                        lambda info: self.local.read_tensor(build.dir, info))
                build.apply(m.version, changes, {n: m.tensors[n].digest for n in changes})
            build.commit()
        except BaseException:
            build.discard()
            raise
        self.on_event(f"installed full version {plan.full.version}")
        for m in plan.deltas:
            self.on_event(f"applied delta version {m.version}")

    def _build_full(self, m: Manifest) -> Build:
        data, arrays = shards.load(self.root, m, self.before_read)
        digests = full_digests(m, arrays)
        del arrays
        layout: dict[str, dict[str, Any]] = {}
        for file, b in data.items():
            for n, info in shards.full_layout(m, file, b).items():
                layout[n] = {**info, "file": file}
        return self.local.build(m.version, data, layout, digests)

    def _apply_delta(self, m: Manifest) -> None:
        state, d = self.local.state(), self.local.data_dir()
        if state is None or d is None or state["version"] != m.base_version:
            raise ChainBroken(f"version {m.version} is against {m.base_version}, local is "
                              f"{None if state is None else state['version']}")
        _, arrays = shards.load(self.root, m, self.before_read)
        changes = delta_changes(m, arrays, state["tensors"], lambda info: self.local.read_tensor(d, info))
        self.local.apply_changes(m.version, changes, {n: m.tensors[n].digest for n in changes})
        self.on_event(f"applied delta version {m.version}")

    # -- the engine -------------------------------------------------------------------------
    def reload_engine(self) -> int | None:
        """Have the engine load the local checkpoint when it is behind; returns its version."""
        if self.adapter is None:
            return self.local.version
        engine_v = self.adapter.health().version
        with self.local.locked(exclusive=False):
            d = self.local.data_dir()
            if d is not None and (d / "journal").exists():
                return engine_v                     # a crashed writer's journal: next round replays it
            v = self.local.version
            if v is None or v <= engine_v:          # never move an engine backwards
                return engine_v
            self._load(v)
        self.on_event(f"engine {self.adapter.engine_name} reloaded version {v}")
        return v

    def _load(self, v: int) -> None:
        """The engine loads the local checkpoint as `v`; with an HMAC key the agent signs it
        (it checked every manifest on the way), for an engine that holds the key too."""
        import inspect
        if not isinstance(self.adapter, ReloadsFromDisk):
            raise _cannot_reload(self.adapter)
        path = str(self.local.model_dir)
        # an engine's own load_from_disk may take no `signature` (asked below)
        load: Callable[..., None] = self.adapter.load_from_disk
        if self.hmac_key is not None and "signature" in inspect.signature(load).parameters:
            from weightsync.wire.signing import checkpoint_signature
            load(path, v, signature=checkpoint_signature(self.hmac_key, path, v))
        else:
            load(path, v)

    def step(self) -> tuple[int | None, int | None]:
        """One round: (local version, engine version)."""
        local = self.sync_local()
        return local, self.reload_engine()

    def backoff(self, interval: float, failures: int) -> float:
        """Seconds to wait after `failures` failed rounds in a row: doubling, at most
        `max_backoff` (never below the poll interval)."""
        return max(interval, min(self.max_backoff, interval * 2.0 ** failures))

    def run(self, interval: float = 0.5, until: int | None = None, once: bool = False,
            timeout: float | None = None, sleep: Callable[[float], None] = time.sleep) -> int | None:
        """Rounds every `interval` seconds until the engine (or, without one, the local
        checkpoint) is at `until`. A failed round is reported and retried after a back-off; in
        loop mode no error ends the agent (`once` raises it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            wait = interval
            try:
                local, engine = self.step()
                failures = 0
            except Exception as e:  # noqa: BLE001 - loop mode outlives any bad input
                if once:
                    raise
                if not isinstance(e, WeightSyncError):
                    log.exception("unexpected error in an agent round")
                failures += 1
                wait = self.backoff(interval, failures)
                self.on_event(f"error (retrying in {wait:.1f}s): {e}")
                local = engine = None
            target = engine if self.adapter is not None else local
            if once or (until is not None and target is not None and target >= until):
                return target
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"agent did not reach version {until} within {timeout}s "
                                       f"(local {local}, engine {engine})")
                wait = min(wait, left)
            sleep(wait)
