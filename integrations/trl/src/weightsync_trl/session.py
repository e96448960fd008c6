"""One weightsync pipeline shared by TRL's two seams (the sync client of GRPOTrainer and the
async trainer's weight_transfer): builds the config, picks the version, pushes, keeps the report
and hands TRL-style metrics to the trainer it is attached to."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from weightsync import SyncConfig, SyncError, SyncReport, WeightSync, WeightSyncError
from weightsync.config import read_config_file

log = logging.getLogger("weightsync.trl")

ConfigSource = str | Path | Mapping[str, Any] | SyncConfig | None
PREFIX = "weightsync/"


def load_config(source: ConfigSource, server_url: str | None = None) -> dict[str, Any]:
    """The sync config as a dict with this integration's defaults: the `vllm` adapter over http,
    paused in mode `keep` as TRL's own client pauses vLLM (requests in flight go on after the
    swap: TRL's async rollout worker fails on the empty completion an abort can return),
    engines that fail reported and skipped (`failure_policy: continue`), and, when the config
    names no engines and no fleet, TRL's own server (`vllm_server_base_url`)."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, SyncConfig):
        data = source.model_dump(exclude_unset=True)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_config_file(Path(source))
    data.setdefault("adapter", "vllm")
    sync = dict(data.get("sync") or {})
    sync.setdefault("failure_policy", "continue")
    adapter = data["adapter"]
    if (adapter.get("kind") if isinstance(adapter, Mapping) else adapter) == "vllm":
        sync.setdefault("pause_mode", "keep")
    data["sync"] = sync
    if not data.get("engines") and not data.get("fleet"):
        if server_url is None:
            raise ValueError("the weightsync config names no engines and no fleet, and TRL gave "
                             "no server URL: add `engines: [{url: ...}]` or `fleet: {kind: "
                             "registry}` to the config")
        data["engines"] = [{"url": server_url}]
    from weightsync.sync.assembly import resolve
    from weightsync.plugins import load_components
    resolve(SyncConfig.load(data), load_components())   # a bad name or option fails now, named
    return data


def metrics_of(report: SyncReport) -> dict[str, float]:
    """TRL-style scalars for one push (the keys GRPOTrainer's `_metrics` averages per log)."""
    ok = sum(o.ok for o in report.engines.values())
    return {f"{PREFIX}sync_s": float(report.seconds.get("total", 0.0)),
            f"{PREFIX}pause_s": float(report.pause_window),
            f"{PREFIX}bytes": float(report.wire_bytes),
            f"{PREFIX}engines_ok": float(ok),
            f"{PREFIX}engines_failed": float(len(report.engines) - ok),
            f"{PREFIX}version": float(report.version)}


class SyncSession:
    """A lazily built `WeightSync` plus the version rule and the trainer to log into.

    Versions continue above what the fleet holds when the first push of the session runs (`base`,
    core's `fleet_version()`: 0 on freshly started servers), so a rerun of the same script against
    running servers pushes `base + 1, ...` instead of being refused as not newer."""

    def __init__(self, config: ConfigSource = None, *, server_url: str | None = None,
                 version: Callable[[], int] | None = None,
                 on_report: Callable[[SyncReport], None] | None = None,
                 step_versions: bool = True) -> None:
        self.config = load_config(config, server_url)
        self.version_fn = version
        self.step_versions = step_versions        # attached: version = the trainer's global step
        self.on_report = on_report
        self.trainer: Any = None
        self.metrics_mode: str | None = None      # None: "train" or "eval" from the model's mode
        self.sync: WeightSync | None = None
        self.reports: list[SyncReport] = []
        self.base: int | None = None              # the fleet's version before this session's first push
        self._counter = 0
        self._lock = threading.Lock()

    @property
    def last_report(self) -> SyncReport | None:
        return self.reports[-1] if self.reports else None

    def open(self) -> WeightSync:
        if self.sync is None:
            self.sync = WeightSync.from_config(self.config)
        return self.sync

    def attach(self, trainer: Any) -> None:
        """Versions from `trainer.state.global_step`; metrics go into `trainer._metrics`."""
        self.trainer = trainer

    def fleet_base(self) -> int:
        """The version the fleet holds before this session's first push (read once): a rerun's
        versions start above it. A fleet that cannot be read counts as 0; the push then names the
        engine that refuses."""
        if self.base is None:
            try:
                self.base = int(self.open().fleet_version() or 0)
            except WeightSyncError as e:
                log.warning("weightsync: could not read the fleet's version (%s); counting from 0", e)
                self.base = 0
            if self.base:
                log.info("weightsync: the servers hold version %d; this run's versions continue "
                         "above it", self.base)
        return self.base

    def next_version(self) -> int:
        """Attached to a trainer: `base` + its global step + 1, the (1-based) step whose rollouts
        these weights generate (TRL syncs at the start of a step; the served checkpoint is version
        0). Else `base` + a counter from 1; `version()` when given. Kept growing if one step
        syncs twice."""
        last = self.sync.last_version if self.sync is not None else None
        if self.version_fn is not None:
            v = int(self.version_fn())
        elif self.step_versions and getattr(self.trainer, "state", None) is not None:
            v = self.fleet_base() + int(self.trainer.state.global_step) + 1
        else:
            self._counter += 1
            v = self.fleet_base() + self._counter
        if last is not None and v <= last:
            v = last + 1
        return v

    def push(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool = False) -> SyncReport:
        """One verified push of `named` to every engine of the fleet, as the next version."""
        with self._lock:
            tensors = {n: (t.detach().clone() if copy else t.detach()) for n, t in named}
            if not tensors:
                raise ValueError("no tensors to sync: TRL's iterator yielded nothing")
            sync = self.open()
            try:
                report = sync.push(tensors, version=self.next_version(),
                                   probe_with=self._policy())
            except SyncError as e:       # no engine took it: keep its report, then raise
                if isinstance(e.report, SyncReport):
                    self.reports.append(e.report)
                    self._log(e.report)
                raise
            self.reports.append(report)
            failed = report.failed
            if failed:
                log.warning("weightsync v%d: %d of %d engines failed: %s", report.version,
                            len(failed), len(report.engines), "; ".join(
                                f"{n} at {report.engines[n].stage}: {report.engines[n].error}"
                                for n in failed))
            self._log(report)
            if self.on_report is not None:
                self.on_report(report)
            return report

    def _policy(self) -> Any:
        """The trainer's model for the probe (it scores the probe sequence and compares with each
        engine), where this process alone can run it: a single-process trainer. In a multi-process
        one the model's forward is a collective the other processes are not in (they do not push)."""
        trainer = self.trainer
        if trainer is None or distributed():
            return None
        acc = getattr(trainer, "accelerator", None)
        return acc.unwrap_model(trainer.model) if acc is not None else trainer.model

    def _log(self, report: SyncReport) -> None:
        """Append the push's scalars to the trainer's `_metrics` (TRL averages them into its next
        log line, as it does for its own `perf/*` keys)."""
        store = getattr(self.trainer, "_metrics", None)
        if store is None:
            return
        model = getattr(self.trainer, "model", None)
        mode = self.metrics_mode or ("train" if model is None or getattr(model, "training", True)
                                     else "eval")
        bucket = store[mode] if mode in store else store.setdefault(mode, {})
        for k, v in metrics_of(report).items():
            if k in bucket:
                bucket[k].append(v)
            else:
                bucket[k] = [v]

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


def distributed() -> bool:
    """Parameters may be gathered views (FSDP, ZeRO-3) that are freed after the iterator moves
    on: copy them then."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()
