"""Logs and metrics of a push: one INFO line per push from the `weightsync` logger, a JSON line
per push in the metrics file, and Prometheus counters and histograms a scraper reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import requests

from weightsync import SyncError, WeightSync
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model


def test_metrics_file_prometheus_and_one_log_line_per_push(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("prometheus_client")
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), name="e",
                       log=tmp_path / "e.log") as eng:
        cfg = {"engines": [eng.spec()],
               "sync": {"progress": "off", "metrics": {"file": str(tmp_path / "pushes.jsonl"),
                                                       "prometheus_port": 0}}}
        caplog.set_level(logging.DEBUG, logger="weightsync")
        with WeightSync.from_config(cfg) as sync:
            sync.push(perturb(sd, 1), version=1)
            sync.push(perturb(sd, 2), version=2)
            bad = perturb(sd, 3)
            bad["model.norm.weight"] = bad["model.norm.weight"][:3]
            with pytest.raises(SyncError):
                sync.push(bad, version=3)
            text = requests.get(f"http://127.0.0.1:{sync.metrics.port}/metrics", timeout=5).text
    lines = [json.loads(x) for x in (tmp_path / "pushes.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2, 3] and [x["ok"] for x in lines] == [True, True, False]
    assert all(x["time"] > 0 and "seconds" in x and "engines" in x for x in lines)
    assert 'weightsync_syncs_total{outcome="ok"} 2.0' in text
    assert 'weightsync_syncs_total{outcome="failed"} 1.0' in text
    assert 'weightsync_engine_failures_total{engine="e",stage="send"} 1.0' in text
    assert 'weightsync_bytes_total{kind="logical"}' in text
    assert 'weightsync_stage_seconds_count{stage="total"} 3.0' in text
    assert "weightsync_pause_window_seconds_count 3.0" in text and "weightsync_version 3.0" in text
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
            and r.name == "weightsync.sync.pipeline" and r.getMessage().startswith("v")]
    assert len(info) == 3 and info[0].startswith("v1: ") and "1/1 engines (1 verified)" in info[0]
    assert any(r.levelno == logging.DEBUG and "stages" in r.getMessage() for r in caplog.records)


def test_prometheus_without_the_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    real = builtins.__import__

    def no_prometheus(name, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name == "prometheus_client":
            raise ImportError("no prometheus_client")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    from weightsync.errors import ConfigError
    with pytest.raises(ConfigError, match=r"pip install 'weightsync-core\[metrics\]'"):
        WeightSync.from_config({"engines": [{"url": "http://127.0.0.1:9"}],
                                "sync": {"metrics": {"prometheus_port": 0}}})
