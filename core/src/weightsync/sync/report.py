"""SyncReport: what one sync did, per engine and per stage. It never says more than was checked:
an engine is `verified` only when it hashed the bytes it holds (or the adapter read them back),
`acknowledged` when it only said it loaded them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["verified", "acknowledged", "failed"]


@dataclass
class EngineOutcome:
    engine: str
    ok: bool
    version: int | None                 # the version the engine holds after this sync (None: unknown)
    stage: str | None = None            # where it failed: health, pause, begin, send, verify, commit...
    error: str | None = None
    seconds: float = 0.0                # from the start of the push until this engine was done
    status: Status | None = None        # verified | acknowledged | failed (None: not reached)
    caught_up: bool = False             # brought from an older version with whole tensors
                                        # (or by a peer join: see `peer`)
    probe: dict[str, Any] | None = None # the probe's |Δ logprob| (mean, max) and the version scored
    pause_window: float = 0.0           # seconds this sync kept the engine paused (0: never, or no answer)
    peer: str | None = None             # caught up by a peer join from this member (None: not)
    peer_error: str | None = None       # why a peer join did not catch it up (the trainer did)
    remark: str | None = None           # what the transport noticed (a relay demoted, and why)

    def fail(self, stage: str, error: str) -> None:
        self.ok, self.stage, self.error, self.status = False, stage, error, "failed"


@dataclass
class SyncReport:
    version: int
    verified: bool = False              # every engine verified what it holds
    logical_bytes: int = 0
    wire_bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    pause_window: float = 0.0           # longest time a live engine was paused by this sync
    engines: dict[str, EngineOutcome] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    density: float | None = None        # changed elements / elements, for delta encodings
    published: bool = False             # publish-only transports: the version was published
    rank: int = 0                       # the trainer rank this report was made on (followers: 0's)
    joined: list[str] = field(default_factory=list)     # fleet members new since the last push
    left: list[str] = field(default_factory=list)       # members gone since the last push
    excluded: dict[str, str] = field(default_factory=dict)  # members not synced, and why
    probe: str | None = None            # what the probe did this push (None: not run)
    senders: dict[int, int] = field(default_factory=dict)  # senders: all: wire bytes per trainer rank

    @property
    def ok(self) -> bool:
        """Every engine reached this version (a publish-only push: the version was published)."""
        return self.published or (bool(self.engines) and all(o.ok for o in self.engines.values()))

    @property
    def failed(self) -> list[str]:
        return [n for n, o in self.engines.items() if not o.ok]

    def versions(self) -> dict[str, int | None]:
        """Which engine holds which version after this sync."""
        return {n: o.version for n, o in self.engines.items()}

    def summary(self) -> str:
        """One line: version, bytes, buckets, seconds, pause window, engines by outcome; then a
        line per failed engine."""
        total = self.seconds.get("total", 0.0)
        line = (f"v{self.version}: {self.logical_bytes / 2**20:.1f} MiB logical, "
                f"{self.wire_bytes / 2**20:.1f} MiB wire, {self.buckets} buckets, {total:.3f}s, "
                f"pause {self.pause_window:.3f}s")
        if self.published:
            line += ", published"
        else:
            counts = {s: sum(o.status == s for o in self.engines.values())
                      for s in ("verified", "acknowledged", "failed")}
            line += (f", {sum(o.ok for o in self.engines.values())}/{len(self.engines)} engines ("
                     + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ")")
        if self.density is not None:
            line += f", density {self.density:.4%}"
        out = self.engines.values()
        notes = ([f"{o.engine} failed at {o.stage} (holds version {o.version}): {o.error}"
                  for o in out if not o.ok]
                 + [f"{o.engine}: no peer join ({o.peer_error}); whole tensors from the trainer instead"
                    for o in out if o.peer_error is not None]
                 + [f"{o.engine}: {o.remark}" for o in out if o.remark is not None]
                 + [f"{name} excluded: {why}" for name, why in self.excluded.items()])
        return line + "".join(f"\n  {n}" for n in notes)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (documented field by field in docs/report.md)."""
        d = asdict(self)
        d["ok"] = self.ok
        d["digests"] = {str(k): v for k, v in self.digests.items()}
        d["senders"] = {str(k): v for k, v in self.senders.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SyncReport":
        """The inverse of `to_json` (a follower rank rebuilds rank 0's report)."""
        d = dict(d)
        d.pop("ok", None)
        engines = {k: EngineOutcome(**v) for k, v in (d.pop("engines", None) or {}).items()}
        digests = {int(k): v for k, v in (d.pop("digests", None) or {}).items()}
        senders = {int(k): v for k, v in (d.pop("senders", None) or {}).items()}
        return cls(**d, engines=engines, digests=digests, senders=senders)


def held_by_most(versions: list[int | None]) -> int | None:
    """The highest version a strict majority of `versions` are at or above (None: none known)."""
    known = sorted((v for v in versions if v is not None), reverse=True)
    return known[len(known) // 2] if known else None
