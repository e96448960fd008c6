"""Replaying a committed journal: after a crash right past the commit point the delta is finished;
if the finished bytes then fail a digest, the values they replaced are not known, so the local
copy is discarded and the next sync installs the newest full version. Journals written by earlier
releases (int32 positions, new and old values) still replay, and their old values still undo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync import WeightSync
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.layout import read_manifest
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import Trainer, bit_equal, publish_config


class Crash(Exception):
    """Stands for the agent dying right after the journal was committed."""


def _two_versions(tmp_path: Path, trainer: Trainer) -> tuple[Path, Agent, dict]:
    root, states = tmp_path / "root", {}
    agent = Agent(root, tmp_path / "local")
    with WeightSync.from_config(publish_config(root)) as sync:
        for v in (1, 2):
            trainer.step()
            states[v] = trainer.state()
            sync.push(states[v], version=v)
            if v == 1:
                assert agent.sync_local() == 1
    return root, agent, states


def _crash_after_commit(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(self: LocalCheckpoint, d: Path, j: object, live: bool) -> None:
        raise Crash()
    with monkeypatch.context() as m:
        m.setattr(LocalCheckpoint, "_forward", crash)
        with pytest.raises(Crash):
            agent.sync_local()
    assert (agent.local.data_dir() / "journal").is_dir()
    assert json.loads((agent.local.data_dir() / "state.json").read_text())["version"] == 1


def _rot(lc: LocalCheckpoint, root: Path, states: dict) -> None:
    """Flip a bit of an element that version 2's sparse delta does not touch."""
    m = read_manifest(root, 2)
    name = next(n for n, t in m.tensors.items() if t.kind == "sparse" and t.changed)
    a, b = (states[v][name].reshape(-1).view(torch.int16) for v in (1, 2))
    same = a == b
    pos = int(same.nonzero()[0])
    info = lc.state()["tensors"][name]
    f = lc.data_dir() / info["file"]
    raw = bytearray(f.read_bytes())
    raw[info["offset"] + 2 * pos + 1] ^= 0x40
    f.write_bytes(bytes(raw))


def test_a_committed_journal_is_finished_on_the_next_open(tmp_path: Path, trainer: Trainer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root, agent, states = _two_versions(tmp_path, trainer)
    _crash_after_commit(agent, monkeypatch)
    lc = LocalCheckpoint(agent.local.path)
    with lc.locked():
        assert lc.version == 2
    assert bit_equal(lc.tensors(), states[2]) == [] and lc.verify() == []


def test_a_replay_that_fails_its_digest_discards_the_copy(tmp_path: Path, trainer: Trainer,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    root, agent, states = _two_versions(tmp_path, trainer)
    _crash_after_commit(agent, monkeypatch)
    _rot(agent.local, root, states)
    d = agent.local.data_dir()
    with caplog.at_level("WARNING", logger="weightsync.disk_delta.local"):
        with agent.local.locked():                 # the replay fails its digests
            assert agent.local.version is None
    assert "not known after a crash" in caplog.text
    assert not d.exists() and not agent.local.model_dir.exists()     # discarded as a whole
    assert agent.sync_local() == 2                 # newest full version, then its chain
    assert bit_equal(agent.local.tensors(), states[2]) == []


@pytest.mark.parametrize("bad_value", [False, True])
def test_a_journal_of_an_earlier_release_replays_and_undoes(tmp_path: Path, trainer: Trainer,
                                                            bad_value: bool,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The first format: `name::idx` (int32), `name::val`, `name::old`; journal.json holds the
    old and new state and no positions form. A wrong new value is undone from `name::old`."""
    root, agent, states = _two_versions(tmp_path, trainer)
    lc = agent.local
    d, s = lc.data_dir(), lc.state()
    m = read_manifest(root, 2)
    arrays = {}
    for n in m.tensors:
        old = states[1][n].reshape(-1).view(torch.int16)
        new = states[2][n].reshape(-1).view(torch.int16)
        idx = (old != new).nonzero().reshape(-1)
        if idx.numel():
            arrays[n + "::idx"] = idx.to(torch.int32)
            arrays[n + "::val"] = new[idx].clone()
            arrays[n + "::old"] = old[idx].clone()
    if bad_value:
        arrays[next(k for k in arrays if k.endswith("::val"))][0] ^= 1
    new_state = {"version": 2, "tensors": {n: {**i, "digest": m.tensors[n].digest}
                                           for n, i in s["tensors"].items()}}
    (d / "journal").mkdir()
    save_file(arrays, str(d / "journal" / "changes.safetensors"))
    (d / "journal" / "journal.json").write_text(json.dumps({"old": s, "new": new_state}))
    if bad_value:
        with caplog.at_level("WARNING", logger="weightsync.disk_delta.local"):
            with lc.locked():
                assert lc.version == 1
        assert "stays at version 1" in caplog.text
        assert bit_equal(lc.tensors(), states[1]) == [] and not (d / "journal").exists()
    else:
        with lc.locked():
            assert lc.version == 2
        assert bit_equal(lc.tensors(), states[2]) == []


def test_mappings_are_released_after_a_write(tmp_path: Path) -> None:
    """The data files' mappings are unmapped on a thread of their own once the write is done:
    the written bytes are in the file, and no mapping stays behind."""
    from weightsync_disk_delta.local import map_file, unmap_later
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(4096))
    maps = [map_file(f)]
    mm, buf = maps[0]
    buf[10:12] = 7
    del buf
    unmap_later(maps).join(timeout=10)
    assert mm.closed and maps == []
    assert f.read_bytes()[10:12] == b"\x07\x07"
