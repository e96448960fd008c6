"""Item 5: a trainer publishes 20 versions of a model trained with a real optimizer while agents
(real processes, the `weightsync-disk-delta` command) keep reference engines current; one host
joins late at version 12 with two engines sharing one local checkpoint. All end bit-equal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from weightsync import WeightSync
from weightsync_reference.processes import EngineProcess
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import Trainer, bit_equal, publish_config, weights_only

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}     # 2 cores, 6 processes: no oversubscription
AGENT = [sys.executable, "-m", "weightsync_disk_delta.cli", "agent"]


def _agent(root: Path, local: Path, engine: EngineProcess, log: Path) -> subprocess.Popen:
    cmd = AGENT + ["--root", str(root), "--local", str(local), "--engine", "reference",
                   "--url", engine.url, "--api-key", "k3y", "--interval", "0.1", "--until", "20",
                   "--timeout", "150"]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ONE_THREAD)


def test_two_hosts_follow_twenty_versions_one_joins_late(tmp_path: Path) -> None:
    tr = Trainer(tmp_path / "model", lr=3e-6)
    served = weights_only(tmp_path / "model", tmp_path / "served")
    root = tmp_path / "root"
    cfg = publish_config(root, full_every=5)          # full versions 1, 6, 11, 16
    engines = [EngineProcess(served, api_key="k3y", log=tmp_path / f"e{i}.log", env=ONE_THREAD)
               for i in range(3)]
    procs: list[subprocess.Popen] = []
    states: dict = {}
    starting: list[threading.Thread] = []
    try:
        engines[0].start()
        t0 = time.monotonic()
        procs.append(_agent(root, tmp_path / "host1", engines[0], tmp_path / "a1.log"))
        with WeightSync.from_config(cfg) as sync:
            for v in range(1, 21):
                tr.step()
                states[v] = tr.state()
                r = sync.push(states[v], version=v)
                assert r.ok and r.density is not None
                if v == 12:                            # host 2 joins: agents first, engines after
                    procs.append(_agent(root, tmp_path / "host2", engines[1], tmp_path / "a2.log"))
                    procs.append(_agent(root, tmp_path / "host2", engines[2], tmp_path / "a3.log"))
                    starting = [threading.Thread(target=e.start) for e in engines[1:]]
                    for t in starting:                 # engines start while the trainer goes on
                        t.start()
                time.sleep(0.15)
        for t in starting:
            t.join(timeout=120)
        t_pub = time.monotonic() - t0
        for p in procs:
            assert p.wait(timeout=160) == 0, (tmp_path / "a1.log").read_text()[-2000:]
        print(f"published in {t_pub:.1f}s, agents done after {time.monotonic() - t0:.1f}s")
        logs = [(tmp_path / f"a{i}.log").read_text() for i in (1, 2, 3)]
        for e in engines:
            assert e.health()["version"] == 20
            assert bit_equal(e.weights(), states[20]) == []
        for host in ("host1", "host2"):
            with LocalCheckpoint(tmp_path / host).locked() as lc:
                assert lc.version == 20 and lc.verify() == []
                assert bit_equal(lc.tensors(), states[20]) == []
        # the late host started from a full version (the newest at or below `latest` when it
        # looked, 11 or later) and its chain
        late = logs[1] + logs[2]
        events = sorted((int(v), what) for what, v in
                        re.findall(r"(installed full|applied delta) version (\d+)", late))
        assert events[0][1] == "installed full" and events[0][0] >= 11, events
        # one local checkpoint on host 2: every version was applied there exactly once
        applied = re.findall(r"(?:applied delta|installed full) version (\d+)", late)
        assert len(applied) == len(set(applied)), applied
        assert "engine" in logs[1] and "reloaded version 20" in logs[1] + logs[2]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for e in engines:
            e.stop()
