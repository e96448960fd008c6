"""A LoRA adapter alone into live vLLM servers, through vLLM's own LoRA routes.

A policy trained with LoRA need not push its base weights at all: engines that serve adapters
load the adapter (a few MiB) by name. vLLM loads an adapter from a directory on the engine's host
(`POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`, enabled by
`--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), so each version is written as PEFT would
write it (adapter_model.safetensors + adapter_config.json) into a new directory `root/name/v<N>`
the engines can read (same host or a shared filesystem), renamed into place once complete, and
every engine is told to load it in place under `name`. A new directory per version keeps vLLM from
reusing prefix-cache blocks computed with the previous adapter. `GET /v1/models` then lists the
adapter with that directory as its root: the version each engine serves.

    pub = LoraPublisher([{"url": "http://127.0.0.1:8000"}], root="/shared/adapters", name="policy")
    pub.push(peft_model, version=step)      # then request {"model": "policy", ...}
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from weightsync.config import EngineSpec
from weightsync.errors import EngineError, SyncError
from weightsync.exporters.lora import adapter_config, adapter_tensors, write_adapter
from weightsync.net.client import auth_headers, call, json_of


@dataclass
class LoraOutcome:
    engine: str
    ok: bool = False
    error: str | None = None
    seconds: float = 0.0


@dataclass
class LoraReport:
    """One adapter push: where the version was written, and what each engine did with it."""

    name: str
    version: int
    path: str | None = None
    bytes: int = 0
    engines: dict[str, LoraOutcome] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.engines.values())


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class LoraPublisher:
    """Writes each adapter version once and has every vLLM server load it under `name`."""

    def __init__(self, engines: Sequence[EngineSpec | Mapping[str, Any]], root: str | Path,
                 name: str = "policy", keep: int = 2, timeout: float = 120.0) -> None:
        if not name or "/" in name:
            raise ValueError(f"adapter name {name!r} must be a non-empty name without '/'")
        if keep < 1:
            raise ValueError("keep must be at least 1 (the version being served)")
        self.engines = [e if isinstance(e, EngineSpec) else EngineSpec(**e) for e in engines]
        self.root = Path(root)
        self.name = name
        self.keep = keep
        self.timeout = timeout
        self.last_version: int | None = None
        self.session = requests.Session()

    def directory(self, version: int) -> Path:
        return self.root / self.name / f"v{version}"

    def push(self, model: Any, version: int, adapter: str | None = None) -> LoraReport:
        """Write `model`'s adapter (PEFT) as `version` and load it into every engine. Every rank
        of a sharded trainer calls this (sharded adapter tensors are gathered); rank 0 writes
        and loads. Raises SyncError (with `.report`) when an engine did not load it."""
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} is not newer than the last pushed version "
                             f"{self.last_version}; versions must grow with every push")
        tensors = adapter_tensors(model, adapter)
        config = adapter_config(model, adapter)
        report = LoraReport(self.name, version)
        if _rank() != 0:
            self.last_version = version
            return report
        path = write_adapter(self.directory(version), tensors, config)
        report.path = str(path)
        report.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with ThreadPoolExecutor(max_workers=max(1, len(self.engines))) as pool:
            outcomes = list(pool.map(lambda e: self._load(e, path), self.engines))
        report.engines = {o.engine: o for o in outcomes}
        if any(o.ok for o in outcomes):
            self.last_version = version
            self._prune()
        if not report.ok:
            failed = [o for o in outcomes if not o.ok]
            raise SyncError(f"adapter {self.name!r} version {version} did not load on "
                            f"{len(failed)} of {len(outcomes)} engines:\n  " +
                            "\n  ".join(f"{o.engine}: {o.error}" for o in failed), report)
        return report

    def request(self, path: Path) -> dict[str, Any]:
        """The body of vLLM's load route for one version."""
        return {"lora_name": self.name, "lora_path": str(path), "load_inplace": True}

    def _load(self, engine: EngineSpec, path: Path) -> LoraOutcome:
        name = engine.name or engine.url
        out = LoraOutcome(name)
        t0 = time.perf_counter()
        base = engine.url.rstrip("/")
        headers = auth_headers(engine.api_key)
        try:
            call(self.session, name, "POST", base + "/v1/load_lora_adapter", timeout=self.timeout,
                 json=self.request(path), headers=headers)
            served = self.served(engine)
            if served != str(path):
                raise EngineError(name, f"after loading, /v1/models lists adapter {self.name!r} "
                                        f"from {served!r}, not {str(path)!r}")
            out.ok = True
        except Exception as e:  # noqa: BLE001 - reported per engine
            out.error = str(e)
        out.seconds = time.perf_counter() - t0
        return out

    def served(self, engine: EngineSpec) -> str | None:
        """The directory the engine serves adapter `name` from (None: not loaded)."""
        name = engine.name or engine.url
        resp = call(self.session, name, "GET", engine.url.rstrip("/") + "/v1/models",
                    timeout=self.timeout, headers=auth_headers(engine.api_key))
        for card in (json_of(resp, name) or {}).get("data", []):
            if card.get("id") == self.name:
                return card.get("root")
        return None

    def _prune(self) -> None:
        """Keep the newest `keep` versions on disk (engines may still be reading the previous)."""
        folder = self.root / self.name
        versions = sorted((int(p.name[1:]), p) for p in folder.glob("v*")
                          if p.is_dir() and p.name[1:].isdigit())
        for _, p in versions[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
