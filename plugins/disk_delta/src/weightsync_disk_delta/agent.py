"""The pull agent of a rollout host: follow `latest`, bring the host-local checkpoint to it (every
delta after its own version; each shard's digest checked before anything is written, each changed
tensor's digest checked on the written bytes before the version becomes current), then have the
engine reload from that checkpoint through its adapter.

A gap in the chain, a missing or corrupt file: fall back to the newest full version and its chain.
A late joiner starts the same way. Several agents on one host share one local checkpoint: the
exclusive lock makes one apply while the others wait and then find it already current."""

from __future__ import annotations

import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from weightsync.bucket import tensor_digest
from weightsync.errors import PayloadError, WeightSyncError
from weightsync.interfaces import Adapter
from weightsync.parallel import map_threads
from weightsync.wire import unpack

from . import kernels, positions
from .codec import IDX_SEP, apply_entry, entry_changes
from .layout import Hook, list_versions, read_latest, read_manifest, read_shard
from .local import Change, LocalCheckpoint

log = logging.getLogger("weightsync.disk_delta.agent")


class ChainBroken(WeightSyncError):
    """The versions between the local one and `latest` cannot be applied one by one."""


class Agent:
    def __init__(self, root: str | Path, local: str | Path, adapter: Adapter | None = None, *,
                 before_read: Hook | None = None, fsync: bool = False,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.local = LocalCheckpoint(local, fsync=fsync)
        self.adapter = adapter
        self.before_read = before_read
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        kernels.warm()             # compiled (or loaded from numba's cache) before the first delta

    # -- the local checkpoint ---------------------------------------------------------------
    def sync_local(self, target: int | None = None) -> int | None:
        """Bring the local checkpoint to `latest` (or to `target` when lower); returns its
        version (None: nothing published yet)."""
        latest = read_latest(self.root, self.before_read)
        if latest is not None and target is not None:
            latest = min(latest, target)
        with self.local.locked(exclusive=True):
            cur = self.local.version
            if latest is None or cur == latest:
                return cur
            self.on_event(f"local {cur} -> latest {latest}")
            try:
                if cur is None or cur > latest:
                    raise ChainBroken(f"local version {cur} cannot reach {latest} by deltas")
                self._apply_chain(cur, latest)
            except (ChainBroken, PayloadError, OSError) as e:
                self.on_event(f"falling back to the newest full version: {e}")
                full = self._install_newest_full(latest)
                if full < latest:
                    self._apply_chain(full, latest)
            return self.local.version

    def _apply_chain(self, cur: int, latest: int) -> None:
        manifests = []
        for v in range(cur + 1, latest + 1):
            m = read_manifest(self.root, v, self.before_read)
            if m["kind"] == "delta" and m["base_version"] != v - 1:
                raise ChainBroken(f"version {v} is a delta against {m['base_version']}, not {v - 1}")
            manifests.append(m)
        fulls = [m for m in manifests if m["kind"] == "full"]
        if fulls:                                   # start from the newest full version in range
            m = fulls[-1]
            self._install_full(m)
            manifests = [x for x in manifests if x["version"] > m["version"]]
        for m in manifests:
            self._apply_delta(m)

    def _install_newest_full(self, latest: int) -> int:
        errors = []
        for v in sorted((v for v in list_versions(self.root) if v <= latest), reverse=True):
            try:
                m = read_manifest(self.root, v, self.before_read)
                if m["kind"] != "full":
                    continue
                self._install_full(m)
                return v
            except (PayloadError, OSError) as e:
                errors.append(str(e))
        raise PayloadError(f"no usable full version at or below {latest} in {self.root}: "
                           + ("; ".join(errors) or "none published"))

    def _load(self, m: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
        data = map_threads(lambda s: read_shard(self.root, m["version"], s), m["shards"])
        shards = {s["file"]: b for s, b in zip(m["shards"], data)}   # read side by side
        arrays: dict[str, torch.Tensor] = {}
        for data in shards.values():
            with warnings.catch_warnings():       # read-only views: nothing writes into them
                warnings.simplefilter("ignore", UserWarning)
                arrays.update(dict(unpack(data)[0]))
        return shards, arrays

    def _install_full(self, m: dict[str, Any]) -> None:
        shards, arrays = self._load(m)

        def check(item: tuple[str, dict[str, Any]]) -> str:
            name, t = item
            new, _, _ = apply_entry(name, t, arrays, None, t["dtype"], t["shape"])
            if tensor_digest(name, new) != t["digest"]:
                raise PayloadError(f"version {m['version']}: tensor {name!r} does not match its digest")
            return t["digest"]
        items = list(m["tensors"].items())
        digests = dict(zip((n for n, _ in items), map_threads(check, items)))
        self.local.install_full(m["version"], shards, digests)
        self.on_event(f"installed full version {m['version']}")

    def _apply_delta(self, m: dict[str, Any]) -> None:
        v = m["version"]
        state = self.local.state()
        d = self.local.data_dir()
        if state is None or d is None or state["version"] != m["base_version"]:
            raise ChainBroken(f"version {v} is against {m['base_version']}, local is "
                              f"{None if state is None else state['version']}")
        if set(m["tensors"]) - set(state["tensors"]):
            raise PayloadError(f"version {v} names tensors the local checkpoint does not have: "
                               f"{sorted(set(m['tensors']) - set(state['tensors']))[:5]}")
        _, arrays = self._load(m)
        for name, t in m["tensors"].items():
            if t.get("base_digest") and t["base_digest"] != state["tensors"][name]["digest"]:
                raise ChainBroken(f"version {v}: tensor {name!r} was made against other bytes than "
                                  f"the local version {state['version']} holds")

        def prepare(item: tuple[str, dict[str, Any]]) -> Change:
            name, t = item
            info = state["tensors"][name]
            idx, vals = entry_changes(name, t, arrays, lambda: self.local.read_tensor(d, info),
                                      t["dtype"], t["shape"])
            if idx is not None and idx.numel() == 0 and t["digest"] != info["digest"]:
                raise PayloadError(f"version {v}: tensor {name!r} is unchanged, but its digest "
                                   f"differs from the local one; the manifest is corrupted")
            stored = None
            if idx is not None and t.get("kind") == "sparse":     # journal the delta's own form
                form = str(t.get("pos", "idx"))
                stored = (form, {k: arrays[name + IDX_SEP + k] for k in positions.arrays_of(form)})
            numel = int(math.prod(t["shape"]))
            return Change.of(idx, vals, numel, stored)

        items = list(m["tensors"].items())
        changes = {name: c for (name, _), c in zip(items, map_threads(prepare, items))
                   if c.idx is None or c.idx.numel()}
        digests = {name: m["tensors"][name]["digest"] for name in changes}
        # shards checked; the written bytes are checked against `digests` before state moves
        self.local.apply_changes(v, changes, digests)
        self.on_event(f"applied delta version {v}")

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
            self.adapter.load_from_disk(str(self.local.model_dir), v)
        self.on_event(f"engine {self.adapter.engine_name} reloaded version {v}")
        return v

    def step(self) -> tuple[int | None, int | None]:
        """One round: (local version, engine version)."""
        local = self.sync_local()
        return local, self.reload_engine()

    def run(self, interval: float = 0.5, until: int | None = None, once: bool = False,
            timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                local, engine = self.step()
            except WeightSyncError as e:
                if once:
                    raise
                self.on_event(f"error (will retry): {e}")
                local = engine = None
            target = engine if self.adapter is not None else local
            if once or (until is not None and target is not None and target >= until):
                return target
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"agent did not reach version {until} within {timeout}s "
                                   f"(local {local}, engine {engine})")
            time.sleep(interval)
