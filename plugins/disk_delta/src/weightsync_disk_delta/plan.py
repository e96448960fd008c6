"""Which published versions bring the host-local checkpoint to `latest`, checked as a whole before
the checkpoint is touched: every manifest against the schema, each delta's base version, its
tensors' dtypes and shapes against the checkpoint they will be applied to (the local one, or the
full version the plan starts from, as the chain changes it), each base digest against the digest
that tensor will have by then, and each shard (a regular file under the root, of the size the
manifest says and no larger than its tensors allow).

Two kinds of plan: the deltas after the local version, applied in place; or the newest full
version at or below `latest` (one inside the chain is preferred) and its deltas, built aside and
swapped in at once. Both end at `latest`, which is above the local version: a host never moves
back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from weightsync.errors import PayloadError, WeightSyncError
from weightsync.wire.pool import map_threads

from .layout import Hook, check_shard, list_versions, read_manifest, stat_shard
from .prepare import check_like_local
from .schema import Manifest
from .shards import shard_limit


class ChainBroken(PayloadError):
    """The versions between the local one and `latest` cannot be applied one by one."""


class PlanError(PayloadError):
    """No checked way leads from the local version to `latest`; nothing was touched."""


class LocalAhead(WeightSyncError):
    """The local checkpoint is newer than what `latest` points at; it is never moved back."""


@dataclass
class Plan:
    target: int
    full: Manifest | None                       # None: the deltas go onto the local checkpoint
    deltas: list[Manifest] = field(default_factory=list)

    def describe(self) -> str:
        parts = [] if self.full is None else [f"full version {self.full.version}"]
        if self.deltas:
            vs = [m.version for m in self.deltas]
            parts.append(f"delta{'s' if len(vs) > 1 else ''} {vs[0]}" + (f"..{vs[-1]}" if len(vs) > 1 else ""))
        return " + ".join(parts) or "nothing"


class Planner:
    def __init__(self, root: Path, before_read: Hook | None = None, key: bytes | None = None) -> None:
        self.root = root
        self.before_read = before_read
        self.key = key                           # HMAC key: manifests must be signed with it
        self._cache: dict[int, Manifest] = {}

    def manifest(self, v: int) -> Manifest:
        """Version v's checked manifest (read once per plan)."""
        m = self._cache.get(v)
        if m is None:
            m = self._cache[v] = read_manifest(self.root, v, self.before_read, self.key)
        return m

    def plan(self, state: dict[str, Any] | None, latest: int,
             on_event: Callable[[str], None] = lambda _: None) -> Plan:
        """A checked plan from `state` (None: an empty checkpoint) to `latest`; PlanError when
        there is none."""
        self._cache = {}
        try:
            self.manifest(latest)                   # every plan ends with it
        except PayloadError as e:
            raise PlanError(f"{e}; nothing was applied") from None
        first: PayloadError | None = None
        if state is not None:
            try:
                return self.from_local(state, latest)
            except PayloadError as e:
                first = e
                on_event(f"cannot apply the versions after the local {state['version']}: {e}; "
                         f"looking for a full version")
        try:
            return self.rebuild(latest, known=str(first) if first else None)
        except PayloadError as e:
            why = f"{first}; and no full version leads there either{e}" if first else str(e)
            raise PlanError(f"cannot reach version {latest}: {why}") from None

    def from_local(self, state: dict[str, Any], latest: int) -> Plan:
        """The versions after the local one; from the newest full one among them if any."""
        cur = int(state["version"])
        ms = [self.manifest(v) for v in range(cur + 1, latest + 1)]
        fulls = [i for i, m in enumerate(ms) if m.kind == "full"]
        if fulls:
            return self._checked(ms[fulls[-1]], ms[fulls[-1] + 1:], latest)
        self.check_chain(cur, dict(state["tensors"]), ms)
        return Plan(latest, None, ms)

    def rebuild(self, latest: int, known: str | None = None) -> Plan:
        """The newest full version at or below `latest` whose chain to `latest` checks.
        `known`: an error already reported, not repeated in this one's message."""
        errors: list[str] = []
        for v in sorted((v for v in list_versions(self.root) if v <= latest), reverse=True):
            try:
                m = self.manifest(v)
                if m.kind != "full":
                    continue
                return self._checked(m, [self.manifest(u) for u in range(v + 1, latest + 1)], latest)
            except PayloadError as e:
                if str(e) not in errors and str(e) != known:
                    errors.append(str(e))
        if known is not None:
            raise ChainBroken("; ".join([""] + errors[:3]))
        raise ChainBroken(f"no usable full version at or below {latest} in {self.root}: "
                          + ("; ".join(errors[:3]) or "none is published"))

    def _checked(self, full: Manifest, deltas: list[Manifest], latest: int) -> Plan:
        self._check_shards(full)
        tensors = {n: {"dtype": t.dtype, "shape": t.shape, "digest": t.digest}
                   for n, t in full.tensors.items()}
        self.check_chain(full.version, tensors, deltas)
        return Plan(latest, full, deltas)

    def check_chain(self, start: int, tensors: dict[str, Any], deltas: list[Manifest]) -> None:
        """Each delta applies to what the one before leaves (`tensors`: name -> dtype, shape,
        digest at version `start`); `tensors` is updated as they would change it."""
        tensors = {n: dict(info) for n, info in tensors.items()}
        prev = start
        for m in deltas:
            if m.kind != "delta" or m.base_version != prev:
                raise ChainBroken(f"version {m.version} is a {m.kind} version against "
                                  f"{m.base_version}, not a delta against {prev}")
            check_like_local(m, tensors)
            for name, t in m.tensors.items():
                if t.base_digest is not None and t.base_digest != tensors[name]["digest"]:
                    raise ChainBroken(f"version {m.version}: tensor {name!r} was made against other "
                                      f"bytes than version {prev} holds")
                tensors[name]["digest"] = t.digest
            self._check_shards(m)
            prev = m.version

    def check_contents(self, deltas: list[Manifest]) -> None:
        """Every shard of these versions against its checksum, read once without keeping it:
        for a chain applied in place, so a corrupt later version stops it before the first
        one is written (the first one's shards are checked as they are loaded)."""
        items = [(m.version, s) for m in deltas for s in m.shards]
        map_threads(lambda vs: check_shard(self.root, vs[0], vs[1]), items)

    def _check_shards(self, m: Manifest) -> None:
        for s in m.shards:
            limit = shard_limit(m.shard_tensors(s.file))
            if s.bytes > limit:
                raise PayloadError(f"version {m.version}: shard {s.file} claims {s.bytes} bytes, more "
                                   f"than its tensors can take ({limit}); it was not read")
            stat_shard(self.root, m.version, s)
