"""The rows of `weightsync bench` that push through weightsync into reference engines: every
usable transport, verified and not, and the `delta` encoding over http and shm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from weightsync_bench.measure import DELTA_DENSITY, Row, perturbed, push_detail, timed
from weightsync_bench.model import model_bytes


class TransportRows:
    """The push rows, as a part of `Bench` (which holds the attributes named here)."""

    receivers: int
    repeat: int
    bucket: int
    version: int
    rows: list[Row]
    log: Callable[[str], None]

    def _floor_of(self, kind: str, receivers: int) -> str | None:
        if kind == "shm":
            return f"shm floor ({receivers + 1} copies)"
        if kind == "http":
            return "http floor (raw TCP)"
        if kind == "collective":
            return ("gloo broadcast, 1 tensor (raw, 1 receiver)" if receivers == 1 and self.receivers > 1
                    else "gloo broadcast, 1 tensor (raw)")
        return None

    def _transport(self, kind: str, sd: dict[str, torch.Tensor], engines: list[Any], label: str,
                   verify: bool = True) -> Row:
        from weightsync_bench.workers import unhashed
        from weightsync.sync.pipeline import WeightSync
        opts: dict[str, Any] = {"timeout": 600} if kind == "collective" else {}
        if kind == "shm":
            opts["device"] = "cpu"
        cfg = {"transport": {"kind": kind, "options": opts}, "adapter": "reference",
               "engines": [e.spec() for e in engines],
               "exporter": {"kind": "torch", "options": {"bucket_bytes": self.bucket}},
               "sync": {"progress": "off", "verify": verify}}
        holder: dict[str, Any] = {}

        def push() -> dict[str, Any]:
            sync = holder["sync"]
            self.version = max(self.version + 1, *(e.health()["version"] + 1 for e in engines))
            r = sync.push(sd, version=self.version)
            if not (r.ok and (r.verified or not verify)):
                raise RuntimeError(f"bench push over {kind} failed: {r.summary()}")
            return push_detail(r)

        def setup() -> None:
            # two untimed pushes (with timed()'s warm-up): a fresh engine's first rounds fault
            # every page (its weights are copy-on-write pages of the checkpoint file, its
            # staging buffers new); from the third push on a training run is in steady state
            holder["sync"] = WeightSync.from_config(cfg)
            push()
        try:
            with unhashed(not verify):
                row = timed(label, "transport", model_bytes(sd), len(engines), push, self.repeat,
                            setup, self.log, floor=self._floor_of(kind, len(engines)))
        finally:
            if "sync" in holder:
                holder["sync"].close()
        row.detail.update({"transport": kind, "verify": verify})
        self.rows.append(row)
        return row

    def _delta(self, kind: str, sd: dict[str, torch.Tensor], engines: list[Any], raw: Row) -> None:
        """The `delta` encoding (disk_delta plugin) over `kind`: every timed push carries a
        version in which DELTA_DENSITY of the elements changed since the previous one."""
        from weightsync.sync.pipeline import WeightSync
        opts: dict[str, Any] = {"device": "cpu"} if kind == "shm" else {}
        cfg = {"transport": {"kind": kind, "options": opts}, "adapter": "reference",
               "encoding": {"kind": "delta", "options": {"full_when_chain_exceeds": 0}},
               "engines": [e.spec() for e in engines],
               "exporter": {"kind": "torch", "options": {"bucket_bytes": self.bucket}},
               "sync": {"progress": "off"}}
        holder: dict[str, Any] = {"model": sd, "seed": 100}

        def setup() -> None:
            holder["sync"] = sync = WeightSync.from_config(cfg)
            self.version = max(self.version + 1, *(e.health()["version"] + 1 for e in engines))
            r = sync.push(sd, version=self.version)     # the full version deltas start from
            if not r.verified:
                raise RuntimeError(f"bench push over {kind} failed: {r.summary()}")

        def prepare() -> None:
            kept = holder["sync"].encoding.settle()      # the trainer's kept-version patch
            holder["kept_s"] = kept
            holder["seed"] += 1
            holder["model"] = perturbed(holder["model"], DELTA_DENSITY, holder["seed"])

        def push() -> dict[str, Any]:
            sync = holder["sync"]
            self.version += 1
            r = sync.push(holder["model"], version=self.version)
            if not r.verified:
                raise RuntimeError(f"bench delta push over {kind} failed: {r.summary()}")
            return {**push_detail(r), "density": r.density, "kept_patch_s": holder.get("kept_s")}
        label = f"delta {DELTA_DENSITY:.0%} over {kind}"
        try:
            row = timed(label, "transport", model_bytes(sd), len(engines), push, self.repeat,
                        setup, self.log, prepare)
        finally:
            if "sync" in holder:
                holder["sync"].encoding.settle()
                holder["sync"].close()
        row.detail.update({"transport": kind, "encoding": "delta", "verify": True,
                           "raw_row": raw.name, "raw_wire_bytes": raw.detail.get("wire_bytes"),
                           "wire_vs_raw": round(row.detail["wire_bytes"] / raw.detail["wire_bytes"], 4)
                           if raw.detail.get("wire_bytes") else None,
                           "seconds_vs_raw": round(row.seconds / raw.seconds, 4),
                           "note": "the sender keeps the last version (one model) for the delta"})
        self.rows.append(row)

