"""An engine left behind by a failed push is brought to the current version by the next push,
also when the encoding is `delta`: it cannot apply a delta made against a version it lacks, so it
gets whole tensors in the same push, and ends bit-exact."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from weightsync import WeightSync
from weightsync.plugins import load_components
from weightsync_reference.processes import EngineProcess, start_all

pytest.importorskip("weightsync_disk_delta")
from weightsync_disk_delta.testing import Trainer, bit_equal, weights_only  # noqa: E402

if "delta" not in load_components().encodings:
    pytest.skip(reason="encoding 'delta' is not installed", allow_module_level=True)


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_lagging_engine_gets_whole_tensors_and_ends_bit_exact(tmp_path: Path, transport: str) -> None:
    tr = Trainer(tmp_path / "model")
    served = weights_only(tmp_path / "model", tmp_path / "served")
    a, b = start_all([EngineProcess(served, name="a", log=tmp_path / "a.log"),
                      EngineProcess(served, name="b", log=tmp_path / "b.log")])
    cfg = {"encoding": {"kind": "delta", "options": {"base_checkpoint": str(tmp_path / "model")}},
           "transport": {"kind": transport, "options": {"device": "cpu"} if transport == "shm" else {}},
           "engines": [a.spec(), {**b.spec(), "options": {"timeout": 2.0}}],
           "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
           "sync": {"progress": "off", "failure_policy": "continue", "deadline": 30}}
    try:
        with WeightSync.from_config(cfg) as sync:
            for v in (1, 2):
                tr.step()
                r = sync.push(tr.state(), version=v)
                assert r.ok and r.verified and r.wire_bytes < r.logical_bytes   # deltas
            os.kill(b.proc.pid, signal.SIGSTOP)           # b misses version 3
            tr.step()
            r = sync.push(tr.state(), version=3)
            assert r.engines["a"].ok and not r.engines["b"].ok
            assert r.versions()["a"] == 3
            os.kill(b.proc.pid, signal.SIGCONT)
            assert b.health()["version"] == 2 and r.engines["b"].stage == "health"
            for v in (4, 5):
                tr.step()
                r = sync.push(tr.state(), version=v)
                assert r.ok and r.verified, r.summary()
                assert r.versions() == {"a": v, "b": v}
                assert not r.engines["a"].caught_up          # a took the delta
                assert r.engines["b"].caught_up == (v == 4)  # b took whole tensors once
                for e in (a, b):
                    assert bit_equal(e.weights(), tr.state()) == [], (e.name, v)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
        a.stop()
        b.stop()


def test_only_lagging_engines_still_move_the_delta_base(tmp_path: Path) -> None:
    """Every engine behind (restarted from the checkpoint the trainer no longer holds as its
    base): they all get whole tensors, and the encoding's base still moves, so the next push is
    a delta again."""
    tr = Trainer(tmp_path / "model")
    served = weights_only(tmp_path / "model", tmp_path / "served")
    with EngineProcess(served, name="a", log=tmp_path / "a.log") as a:
        cfg = {"encoding": {"kind": "delta", "options": {"base_checkpoint": str(tmp_path / "model"),
                                                         "base_version": 5}},
               "transport": "http", "engines": [a.spec()],
               "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
               "sync": {"progress": "off"}}
        with WeightSync.from_config(cfg) as sync:
            tr.step()
            r = sync.push(tr.state(), version=6)           # a is at 0, the base is 5
            assert r.ok and r.verified and r.engines["a"].caught_up
            assert bit_equal(a.weights(), tr.state()) == []
            tr.step()
            r = sync.push(tr.state(), version=7)
            assert r.ok and not r.engines["a"].caught_up and r.wire_bytes < r.logical_bytes
            assert bit_equal(a.weights(), tr.state()) == []
