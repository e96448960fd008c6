"""Item 3: a crash at any moment leaves the host-local checkpoint at a whole version. The agent
(a real process, the `weightsync-disk-delta` command) is SIGKILLed at random points while it
applies a chain of deltas; the checkpoint must then hold exactly one published version, bit for
bit, and a restarted agent must finish the job."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weightsync import WeightSync
from weightsync.bucket import digest_tensors
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import Trainer, bit_equal, publish_config

TRIALS = 21
LAST = 12


def _run_agent(root: Path, local: Path, kill_after: float | None, fsync: bool) -> tuple[str, float]:
    """Start the agent; SIGKILL it `kill_after` seconds after it is ready (None: let it finish).
    Returns (its output, seconds from ready to its last applied version)."""
    cmd = [sys.executable, "-m", "weightsync_disk_delta.cli", "agent", "--root", str(root),
           "--local", str(local), "--engine", "none", "--once"] + (["--fsync"] if fsync else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = p.stdout.readline()               # printed once imports are done
        assert first.startswith("agent: following"), first
        first += p.stdout.readline()              # "local 1 -> latest 12": the work starts now
        assert "-> latest" in first, first
        t0 = time.monotonic()
        if kill_after is not None:
            time.sleep(kill_after)
            p.send_signal(signal.SIGKILL)
            out = first + p.stdout.read()
            p.wait(timeout=60)
            return out, 0.0
        out, last = first, 0.0
        for line in p.stdout:
            out += line
            if "applied delta" in line:
                last = time.monotonic() - t0
        p.wait(timeout=60)
        return out, last
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_kill_at_random_points_leaves_a_whole_version(tmp_path: Path) -> None:
    tr = Trainer(tmp_path / "model", lr=2e-5, hidden=256, intermediate=512, vocab=4096)
    root = tmp_path / "root"
    template = tmp_path / "template"
    digests: dict[int, dict[str, str]] = {}
    states: dict = {}
    # a pure chain: version 1 full, 2..12 deltas (no full version forced in between)
    with WeightSync.from_config(publish_config(root, full_when_chain_exceeds=0)) as sync:
        for v in range(1, LAST + 1):
            tr.step()
            states[v] = tr.state()
            digests[v] = {n: digest_tensors([(n, t)]) for n, t in states[v].items()}
            sync.push(states[v], version=v)
            if v == 1:
                assert Agent(root, template).sync_local() == 1     # hosts start at version 1
    out, work = _run_agent(root, _copy(template, tmp_path / "calibrate"), None, fsync=True)
    assert f"applied delta version {LAST}" in out, out
    rng = random.Random(1234)
    plan = [(t, rng.uniform(0, work * 1.2), t % 2 == 0) for t in range(TRIALS)]

    def run_trial(p: tuple[int, float, bool]) -> str:
        n, kill_after, fsync = p
        local = tmp_path / f"trial{n}"
        if n % 3:
            _copy(template, local)                 # a host at version 1 applies deltas 2..12
        return _run_agent(root, local, kill_after, fsync)[0]   # else a new host: full copy first

    with ThreadPoolExecutor(max_workers=3) as pool:   # a few at once: the box has 2 cores
        outs = list(pool.map(run_trial, plan))
    seen: dict[int, int] = {}
    for trial, out in enumerate(outs):
        local = tmp_path / f"trial{trial}"
        lc = LocalCheckpoint(local)
        with lc.locked():                          # replays a committed journal, drops half-made files
            v = lc.version
            if v is None:                          # a new host killed before its first copy landed
                assert trial % 3 == 0, (trial, out)
                assert not list(local.glob("data-*")) and not list(local.glob(".model*")), out
            else:
                assert 1 <= v <= LAST, (trial, v, out)
                got = {n: digest_tensors([(n, t)]) for n, t in lc.tensors().items()}
                assert got == digests[v], f"trial {trial}: checkpoint is not whole version {v}\n{out}"
                assert lc.verify() == []
                assert not [p.name for p in lc.data_dir().iterdir() if p.name.startswith(".")]
        seen[v or 0] = seen.get(v or 0, 0) + 1
        if trial % 4 == 0:                         # a restarted agent finishes the chain
            assert Agent(root, local).sync_local() == LAST
            assert bit_equal(LocalCheckpoint(local).tensors(), states[LAST]) == []
    print(f"versions the killed agents left: {dict(sorted(seen.items()))}")
    # the kills landed inside the work, not only before or after it
    assert sum(n for v, n in seen.items() if 1 < v < LAST) >= TRIALS // 5, seen


def _copy(template: Path, dst: Path) -> Path:
    shutil.copytree(template, dst, symlinks=True)
    return dst
