"""A crash at any moment leaves the host-local checkpoint at a whole version. Agent processes are
killed with SIGKILL, from outside, while they apply a chain of deltas in place, write and drop
journals, move state, put old values back after a delta failed its digests (undo), finish a
journal after an earlier crash (replay), and build a full version aside and swap it in (a new
host, and a host whose chain holds a newer full version). After every kill the checkpoint, once
opened again, holds exactly one published version, bit for bit; a restarted agent finishes.

Most trials run in children forked from one server process that imported the agent once
(tests/killhost.py), and are killed at a chosen step, at once or a random moment later, so they
land inside the short steps of a tiny model. The command's own process (the
`weightsync-disk-delta` CLI) is also killed at random moments."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import (next_version, publish, raw_manifest, set_shard_arrays,
                                           shard_arrays, whole_version)

KILLHOST = Path(__file__).with_name("killhost.py")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


class KillHost:
    """The fork server: one trial at a time, each a child process killed on request."""

    def __init__(self, log: Path) -> None:
        self.p = subprocess.Popen([sys.executable, str(KILLHOST)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                  env=ONE_THREAD)
        assert self.p.stdout is not None
        assert "ready" in json.loads(self.p.stdout.readline()), log.read_text()[-3000:]

    def trial(self, root: Path, local: Path, at: str, nth: int = 1, delay: float = 0.0,
              target: int | None = None, fsync: bool = False) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        req = {"root": str(root), "local": str(local), "log": str(local) + ".log", "at": at,
               "nth": nth, "delay": delay, "target": target, "fsync": fsync}
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(timeout=60)


def _model() -> dict[str, torch.Tensor]:
    """12 tensors, 3 MiB: steps of a few milliseconds, so kills land inside them."""
    g = torch.Generator().manual_seed(11)
    out = {f"layers.{i}.w": torch.randn(256, 512, generator=g).to(torch.bfloat16) for i in range(11)}
    out["norm.weight"] = torch.randn(512, generator=g)
    return out


class Chain:
    """Versions 1 (full), 2..6 (deltas), 7 (full), 8..10 (deltas) in `root`; `bad` is the same
    with version 4 corrupted before its checksum was taken (it fails a digest once written);
    templates of a host at version 1 and at version 3."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.states = {1: _model()}
        for v in range(2, 11):
            self.states[v] = next_version(self.states[v - 1], v, density=0.02)
        self.root = base / "root"
        publish(self.root, self.states, full_every=6)
        assert [raw_manifest(self.root, v)["kind"] for v in (1, 6, 7, 8)] == \
            ["full", "delta", "full", "delta"]
        self.bad = base / "bad"
        shutil.copytree(self.root, self.bad)
        file = next(s["file"] for s in raw_manifest(self.bad, 4)["shards"])
        arrays = shard_arrays(self.bad, 4, file)
        key = next(k for k in sorted(arrays) if k.endswith("::val"))
        arrays[key].view(torch.int16)[0] ^= 1
        set_shard_arrays(self.bad, 4, file, arrays)
        self.at1, self.at3, self.at7 = base / "at1", base / "at3", base / "at7"
        assert Agent(self.root, self.at1).sync_local(1) == 1
        assert Agent(self.root, self.at3).sync_local(3) == 3
        assert Agent(self.root, self.at7).sync_local(7) == 7
        self.n = 0

    def host(self, start: int | None) -> Path:
        """A fresh host: a copy of the template at `start` (None: a new, empty host)."""
        self.n += 1
        local = self.base / f"host{self.n}"
        if start is not None:
            shutil.copytree({1: self.at1, 3: self.at3, 7: self.at7}[start], local, symlinks=True)
        return local


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    return Chain(tmp_path_factory.mktemp("kills"))


@pytest.fixture(scope="module")
def killhost(chain: Chain) -> Iterator[KillHost]:
    k = KillHost(chain.base / "killhost.log")
    yield k
    k.close()


def _after(local: Path, states: dict, allowed: set[int | None]) -> int | None:
    """The version the host holds once its checkpoint is opened again (whole, bit for bit)."""
    v = whole_version(local, states)
    assert v in allowed, (v, allowed, local.with_name(local.name + ".log").read_text()[-2000:])
    if v is None:
        assert sorted(p.name for p in local.iterdir()) == [".lock"], sorted(local.iterdir())
    return v


def _delays(rng: random.Random, n: int, top: float) -> list[float]:
    """n kill delays: the first at the step itself, the others at random inside `top` s."""
    return [0.0] + [rng.uniform(0.00005, top) for _ in range(n - 1)]


def test_kills_while_deltas_are_applied_in_place(chain: Chain, killhost: KillHost) -> None:
    """A host at version 1 applies deltas 2..6 in place: killed while a delta is written and
    checked, and exactly at the journal's commit, state's move and the journal's drop."""
    rng = random.Random(1)
    outcomes = []
    for at, nth, delay in (
            [("forward", n, d) for n, d in zip([1, 2, 3, 4, 5, 2, 3, 4, 5, 5],
                                                _delays(rng, 10, 0.006))]
            + [("journal", 2, 0.0), ("journal", 4, 0.0005), ("state", 1, 0.0), ("state", 3, 0.0),
               ("drop", 2, 0.0), ("drop", 5, 0.0002), ("write", 3, 0.001), ("write", 4, 0.0)]):
        local = chain.host(1)
        r = killhost.trial(chain.root, local, at, nth, delay, target=6, fsync=nth % 2 == 0)
        v = _after(local, chain.states, {1, 2, 3, 4, 5, 6})
        outcomes.append((at, nth, r["killed"], v))
    print(f"in place: {outcomes}")
    killed = [o for o in outcomes if o[2]]
    assert len(killed) >= 14, outcomes
    assert len({v for *_, v in killed}) >= 4, outcomes      # they landed all along the chain


def test_kills_while_old_values_are_put_back(chain: Chain, killhost: KillHost) -> None:
    """Version 4 fails its digests once written, so the host puts the old values back: killed
    while it does, the next open finishes putting them back, at version 3. Killed before the
    values to put back are recorded (the write of a bad delta itself), the copy cannot be made
    whole again and is discarded as a whole: no version, nothing mixed; a restarted agent
    installs a full version."""
    rng = random.Random(2)
    undone = discarded = 0
    outcomes = []
    for at, delay in ([("restore", d) for d in _delays(rng, 9, 0.004)]
                      + [("undo-record", 0.0), ("undo-record", 0.0003)]):
        local = chain.host(1)
        r = killhost.trial(chain.bad, local, at, 1, delay, target=6)
        record = any((d / "journal" / "undo.safetensors").exists() for d in local.glob("data-*"))
        v = _after(local, chain.states, {3} if at == "restore" else {3, None})
        outcomes.append((at, r["killed"], record, v))
        undone += r["killed"] and record and v == 3
        if v is None:
            discarded += 1
            assert Agent(chain.bad, local).sync_local(3) == 3
            assert whole_version(local, chain.states) == 3
    print(f"undo: {outcomes}")
    assert undone >= 4, outcomes                             # killed while putting values back


def test_kills_while_a_journal_is_replayed(chain: Chain, killhost: KillHost) -> None:
    """Killed while writing delta 2..5 (its journal committed), then killed again while the
    next open replays that journal: the third open finishes it."""
    rng = random.Random(3)
    outcomes = []
    for nth, delay in zip([1, 2, 3, 4, 2, 3, 4, 1, 2, 3], _delays(rng, 10, 0.004)):
        local = chain.host(1)
        first = killhost.trial(chain.root, local, "forward", nth, 0.0, target=6)
        assert first["killed"] and (LocalCheckpoint(local).data_dir() / "journal").is_dir()
        second = killhost.trial(chain.root, local, "replay", 1, delay, target=6)
        journal_left = (LocalCheckpoint(local).data_dir() / "journal").is_dir()
        v = _after(local, chain.states, {nth + 1, 6} if not second["killed"] else {nth + 1})
        outcomes.append((nth, second["killed"], journal_left, v))
    print(f"replay: {outcomes}")
    assert sum(k and j for _, k, j, _ in outcomes) >= 5, outcomes


def test_kills_while_a_full_version_is_built_and_swapped_in(chain: Chain, killhost: KillHost) -> None:
    """A new host (nothing yet) and a host at version 3 whose chain holds the full version 7
    both build version 7 and its deltas 8..10 aside and swap them in at once: killed anywhere,
    they hold what they had, or version 10. Killed as the swap begins, they hold what they had;
    killed once it returned, version 10 (both at the step itself, so every trial run covers
    both sides of the commit point whatever the machine's load)."""
    rng = random.Random(4)
    steps = [("build", 1), ("build-apply", 1), ("build-apply", 2), ("build-apply", 3),
             ("commit", 1), ("state", 1), ("write", 2)]
    outcomes = []
    for start in (None, 3):
        trials = list(zip(steps + [("build", 1), ("commit", 1)],
                          _delays(rng, len(steps) + 2, 0.005)))
        for (at, nth), delay in trials + [(("commit", 1), 0.0), (("commit:after", 1), 0.0)]:
            local = chain.host(start)
            r = killhost.trial(chain.root, local, at, nth, delay, target=10)
            aside = [d.name for d in local.glob("data-*")]
            v = _after(local, chain.states, {start, 10})
            outcomes.append((start, at, r["killed"], len(aside), v))
            if delay == 0.0 and at.startswith("commit"):
                assert r["killed"] and v == (10 if at == "commit:after" else start), outcomes
    print(f"full builds: {outcomes}")
    killed = [o for o in outcomes if o[2]]
    assert len(killed) >= 12, outcomes


# -- the command itself, killed at random moments ----------------------------------------------

CLI_TRIALS = 6


def _run_agent(root: Path, local: Path, kill_after: float) -> str:
    """Start the agent command; SIGKILL it `kill_after` seconds after it started working."""
    cmd = [sys.executable, "-m", "weightsync_disk_delta.cli", "agent", "--root", str(root),
           "--local", str(local), "--engine", "none", "--once"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=ONE_THREAD)
    try:
        assert p.stdout is not None
        first = p.stdout.readline()               # printed once imports are done
        assert first.startswith("agent: following"), first
        first += p.stdout.readline()              # "local 1 -> latest 10": the work starts now
        assert "-> latest" in first, first
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
        out = first + p.stdout.read()
        p.wait(timeout=60)
        return out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_command_killed_at_random_moments_leaves_a_whole_version(chain: Chain,
                                                                    killhost: KillHost) -> None:
    """The `weightsync-disk-delta agent` process itself, SIGKILLed at a random moment of its
    work: hosts at version 1 and new hosts (a full version built aside), hosts at version 7
    (deltas 8..10 in place)."""
    t0 = time.monotonic()
    killhost.trial(chain.root, chain.host(1), "none", target=10)          # how long the work takes
    work = time.monotonic() - t0
    rng = random.Random(1234)
    plan = [([1, 7, None][n % 3], rng.uniform(0, work * 1.5)) for n in range(CLI_TRIALS)]
    hosts = [chain.host(start) for start, _ in plan]

    def run_trial(n: int) -> str:
        return _run_agent(chain.root, hosts[n], plan[n][1])

    with ThreadPoolExecutor(max_workers=3) as pool:   # a few at once: the box has 2 cores
        outs = list(pool.map(run_trial, range(CLI_TRIALS)))
    seen = []
    for (start, _), local, out in zip(plan, hosts, outs):
        allowed = {None, 10} if start is None else ({1, 10} if start == 1 else {7, 8, 9, 10})
        seen.append(_after(local, chain.states, allowed))
        assert Agent(chain.root, local).sync_local() == 10           # a restarted agent finishes
        assert whole_version(local, chain.states) == 10
    print(f"versions the killed commands left: {seen}")
