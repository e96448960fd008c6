"""SyncReport: what one sync did, per engine and per stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EngineOutcome:
    engine: str
    ok: bool
    version: int | None                 # the version the engine is at after this sync
    stage: str | None = None            # where it failed: health, pause, begin, send, verify, commit
    error: str | None = None
    seconds: float = 0.0


@dataclass
class SyncReport:
    version: int
    verified: bool = False
    logical_bytes: int = 0
    wire_bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    pause_window: float = 0.0
    engines: dict[str, EngineOutcome] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    density: float | None = None        # changed elements / elements, for delta encodings

    @property
    def ok(self) -> bool:
        return bool(self.engines) and all(o.ok for o in self.engines.values())

    @property
    def failed(self) -> list[str]:
        return [n for n, o in self.engines.items() if not o.ok]

    def summary(self) -> str:
        total = self.seconds.get("total", 0.0)
        ok = sum(o.ok for o in self.engines.values())
        line = (f"v{self.version}: {self.logical_bytes / 2**20:.1f} MiB logical, "
                f"{self.wire_bytes / 2**20:.1f} MiB wire, {self.buckets} buckets, {total:.3f}s, "
                f"pause {self.pause_window:.3f}s, {ok}/{len(self.engines)} engines, "
                f"verified={self.verified}")
        if self.density is not None:
            line += f", density {self.density:.4%}"
        for o in self.engines.values():
            if not o.ok:
                line += f"\n  {o.engine} failed at {o.stage}: {o.error}"
        return line

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["digests"] = {str(k): v for k, v in self.digests.items()}
        return d
