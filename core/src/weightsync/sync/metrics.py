"""Sync metrics for monitoring: one JSON line per push appended to a file, and, with the optional
`prometheus-client` (`weightsync-core[metrics]`), counters, histograms and gauges on a port for
Prometheus to scrape (the names and labels: docs/report.md, docs/rl.md)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import ConfigError

if TYPE_CHECKING:
    from weightsync.sync.report import SyncReport


class MetricsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str | None = Field(None, description="append one JSON line per push here")
    prometheus_port: int | None = Field(None, ge=0, le=65535, description=(
        "serve Prometheus metrics on this port (0: any free port; needs prometheus-client)"))
    prometheus_host: str = Field("127.0.0.1", description="address the metrics port listens on")


class Metrics:
    def __init__(self, settings: MetricsSettings | None) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.port: int | None = None
        self._m: dict[str, Any] = {}
        self._server: Any = None
        if settings is not None and settings.prometheus_port is not None:
            self._start(settings)

    def _start(self, s: MetricsSettings) -> None:
        try:
            import prometheus_client as p
        except ImportError:
            raise ConfigError("sync.metrics.prometheus_port needs prometheus-client: "
                              "pip install 'weightsync-core[metrics]'") from None
        reg = p.CollectorRegistry()
        buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
        self._m = {
            "syncs": p.Counter("weightsync_syncs", "pushes by outcome", ["outcome"], registry=reg),
            "failures": p.Counter("weightsync_engine_failures", "failed engines by stage",
                                  ["engine", "stage"], registry=reg),
            "bytes": p.Counter("weightsync_bytes", "bytes pushed", ["kind"], registry=reg),
            "stage": p.Histogram("weightsync_stage_seconds", "seconds per stage", ["stage"],
                                 buckets=buckets, registry=reg),
            "pause": p.Histogram("weightsync_pause_window_seconds", "longest pause of a push",
                                 buckets=buckets, registry=reg),
            "density": p.Gauge("weightsync_density", "changed elements / elements", registry=reg),
            "version": p.Gauge("weightsync_version", "last version pushed", registry=reg),
            "probe": p.Gauge("weightsync_probe_gap", "the probe's max |d logprob|", ["engine"],
                             registry=reg),
            "gap": p.Gauge("weightsync_logprob_gap", "train-inference |d logprob| of rollouts",
                           ["engine", "stat"], registry=reg),
        }
        assert s.prometheus_port is not None        # started only with a port
        server, _ = p.start_http_server(s.prometheus_port, addr=s.prometheus_host, registry=reg)
        self._server = server
        self.port = server.server_address[1]

    def record(self, report: SyncReport) -> None:
        if self.settings is None:
            return
        with self.lock:
            self._append(report.to_json())
            if self._m:
                m = self._m
                m["syncs"].labels("ok" if report.ok else "failed").inc()
                for o in report.engines.values():
                    if not o.ok:
                        m["failures"].labels(o.engine, o.stage or "unknown").inc()
                m["bytes"].labels("logical").inc(report.logical_bytes)
                m["bytes"].labels("wire").inc(report.wire_bytes)
                for stage, sec in report.seconds.items():
                    m["stage"].labels(stage).observe(sec)
                m["pause"].observe(report.pause_window)
                if report.density is not None:
                    m["density"].set(report.density)
                m["version"].set(report.version)
                for o in report.engines.values():
                    if o.probe is not None:
                        m["probe"].labels(o.engine).set(o.probe["max"])

    def record_gap(self, engine: str, version: int, mean: float, max_: float) -> None:
        """The train–inference gap of rollouts `engine` generated at `version`."""
        if self.settings is None:
            return
        with self.lock:
            self._append({"gap": {"engine": engine, "version": version, "mean": mean, "max": max_}})
            if self._m:
                self._m["gap"].labels(engine, "mean").set(mean)
                self._m["gap"].labels(engine, "max").set(max_)

    def _append(self, entry: dict[str, Any]) -> None:
        """One timestamped JSON line to the metrics file, if one is set (callers hold the lock)."""
        if self.settings is not None and self.settings.file:
            with open(Path(self.settings.file), "a") as f:
                f.write(json.dumps({"time": time.time(), **entry}) + "\n")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
