"""A member that is behind on a relay shape is caught up by a peer within the push, not by the
trainer: with the delta encoding, an engine that restarted (back at version 0) lacks the delta's
base; the push's main round goes through the chain, then the restarted engine pulls the new
version from the least loaded current member (the chain's last one), checking every tensor
against the trainer's digests. When that peer refuses or lies, the trainer's whole-tensor round
catches it up and the report says why. Real reference engines on loopback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync import WeightSync
from weightsync.plugins import load_components
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import running
from weightsync.testing.sample import sample_state_dict, write_weights_only_model

HERE = Path(__file__).resolve().parent
BUCKET = 64 << 10            # several buckets per push
PIECE = 4096

if "delta" not in load_components().encodings:
    pytest.skip(reason="no 'delta' encoding is registered (its plugin is not installed)",
                allow_module_level=True)


def config(engines: list[EngineProcess], shape: str = "chain") -> dict[str, Any]:
    return {"adapter": "reference", "engines": [e.spec() for e in engines],
            "transport": {"kind": "http", "options": {"shape": shape, "piece_bytes": PIECE}},
            # never a forced full version: every push after the first is a delta on the last
            "encoding": {"kind": "delta", "options": {"full_when_chain_exceeds": 0}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": BUCKET}},
            "sync": {"progress": "off", "deadline": 60, "failure_policy": "continue"}}


def step(sd: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A new version in which about one element in 50 of every floating tensor changes (so the
    delta is much smaller than the model, and a whole copy would show in the wire bytes)."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for n, t in sd.items():
        if t.is_floating_point() and t.numel():
            flat = t.float().flatten().clone()
            at = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
            flat[at] += 0.5 + torch.rand(at.numel(), generator=g)
            out[n] = flat.reshape(t.shape).to(t.dtype)
        else:
            out[n] = t.clone()
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = sample_state_dict(scale=2)
    return write_weights_only_model(tmp_path_factory.mktemp("relay_catchup") / "model", sd), sd


@pytest.fixture
def fleet(model: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, request: Any
          ) -> Iterator[list[EngineProcess]]:
    """Four engines; e3 (the chain's last member once e1 is behind) runs `request.param`'s
    bad-peer mode when one is given."""
    mode = getattr(request, "param", None)
    programs = {3: [sys.executable, str(HERE / "bad_peer.py"), mode]} if mode else None
    with running(model[0], tmp_path, 4, programs) as engines:
        yield engines


def push_two_then_restart(sync: WeightSync, fleet: list[EngineProcess],
                          sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """v1 and v2 reach all four through the chain; then e1 restarts (back at version 0)."""
    for v in (1, 2):
        sd = step(sd, v)
        report = sync.push(sd, version=v)
        assert report.ok and report.verified, report.summary()
        assert not any(o.caught_up for o in report.engines.values()), report.summary()
    fleet[1].stop()
    fleet[1].start(timeout=120)
    assert fleet[1].health()["version"] == 0
    return sd


def check_next_push_takes_everyone_in_the_main_round(
        sync: WeightSync, fleet: list[EngineProcess], sd: dict[str, torch.Tensor]) -> None:
    """v4: the delta's base is v3, which e1 now holds: all four take the delta through the chain."""
    relayed_before = fleet[1].health()["relay"]["received"]
    sd = step(sd, 4)
    report = sync.push(sd, version=4)
    assert report.ok and report.verified, report.summary()
    assert report.wire_bytes < report.logical_bytes, report.summary()      # only the delta
    for e in fleet:
        o = report.engines[e.name]
        assert not o.caught_up and o.peer is None and o.peer_error is None, o
        assert e.health()["version"] == 4 and e.holds(sd), e.name
    assert fleet[1].health()["relay"]["received"] == relayed_before + report.buckets


def test_a_restarted_member_is_caught_up_by_the_chains_last_member(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    with WeightSync.from_config(config(fleet)) as sync:
        sd = push_two_then_restart(sync, fleet, model[1])
        sd = step(sd, 3)
        report = sync.push(sd, version=3)
        assert report.ok and report.verified, report.summary()
        joiner = report.engines["e1"]
        assert joiner.caught_up and joiner.peer == "e3" and joiner.peer_error is None, joiner
        assert joiner.version == 3 and joiner.status == "verified", joiner
        for name in ("e0", "e2", "e3"):
            assert not report.engines[name].caught_up and report.engines[name].peer is None
        # the trainer sent no whole copy: its wire bytes are the chain's delta alone
        assert report.wire_bytes < report.logical_bytes, report.summary()
        health = {e.name: e.health() for e in fleet}
        assert health["e1"]["peer"]["pulled"] == 1 and health["e1"]["peer"]["from"] == fleet[3].url
        assert health["e1"]["relay"]["received"] == 0          # nothing of v3 from the trainer
        assert health["e3"]["peer"]["served_buckets"] > 0, health["e3"]
        assert health["e0"]["peer"]["served_buckets"] == health["e2"]["peer"]["served_buckets"] == 0
        for e in fleet:
            assert health[e.name]["version"] == 3 and e.holds(sd), e.name
        check_next_push_takes_everyone_in_the_main_round(sync, fleet, sd)


@pytest.mark.parametrize("fleet,why", [
    ("refuse", "refuses to share"),
    ("lie", "served other weights than the trainer pushed")], indirect=["fleet"])
def test_a_peer_that_refuses_or_lies_leaves_the_member_to_the_trainer(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]], why: str) -> None:
    """e3 is the peer e1 would pull from; it refuses the share, or serves shifted weights with a
    manifest that agrees with them (only the trainer's digests catch that). e1 gets whole tensors
    from the trainer in the same push, ends bit-exact, and the report says why."""
    with WeightSync.from_config(config(fleet)) as sync:
        sd = push_two_then_restart(sync, fleet, model[1])
        sd = step(sd, 3)
        report = sync.push(sd, version=3)
        assert report.ok and report.verified, report.summary()
        joiner = report.engines["e1"]
        assert joiner.caught_up and joiner.peer is None, joiner
        assert joiner.peer_error and "peer join from e3 failed" in joiner.peer_error \
            and why in joiner.peer_error, joiner
        assert "e1: no peer join (peer join from e3 failed" in report.summary()
        assert report.wire_bytes > report.logical_bytes, report.summary()  # a whole copy too
        assert fleet[1].health()["peer"]["pulled"] == 0
        for e in fleet:
            assert e.health()["version"] == 3 and e.holds(sd), e.name
        check_next_push_takes_everyone_in_the_main_round(sync, fleet, sd)


def test_star_keeps_the_trainers_whole_tensor_round(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Star (the default) is what it says: the trainer sends every engine its own copy, so the
    restarted engine gets whole tensors from the trainer and no member serves a peer join."""
    with WeightSync.from_config(config(fleet, "star")) as sync:
        sd = push_two_then_restart(sync, fleet, model[1])
        sd = step(sd, 3)
        report = sync.push(sd, version=3)
        assert report.ok and report.verified, report.summary()
        joiner = report.engines["e1"]
        assert joiner.caught_up and joiner.peer is None and joiner.peer_error is None, joiner
        assert report.wire_bytes > report.logical_bytes, report.summary()  # a whole copy too
        for e in fleet:
            h = e.health()
            assert h["peer"]["served_buckets"] == 0 and h["peer"]["pulled"] == 0, (e.name, h)
            assert h["version"] == 3 and e.holds(sd), e.name


def test_joiners_spread_over_peers_leaves_first() -> None:
    """Fewest joiners assigned first; among equals a member that feeds no one in the relay plan,
    then by name."""
    from weightsync_reference.adapter import ReferenceAdapter
    from weightsync.sync.peer_join import pick_peers
    from weightsync.config import EngineSpec

    def adapter(name: str) -> ReferenceAdapter:
        return ReferenceAdapter(None, EngineSpec(url="http://127.0.0.1:9", name=name))
    peers = [adapter(n) for n in ("a", "b", "c")]
    joiners = [adapter(n) for n in ("x", "y", "z", "w")]
    chain = {"a": ["b"], "b": ["c"], "c": []}
    got = {j: p.engine_name for j, p in pick_peers(joiners, peers, chain).items()}
    assert got == {"x": "c", "y": "a", "z": "b", "w": "c"}, got
    got = {j: p.engine_name for j, p in pick_peers(joiners[:2], peers, {}).items()}
    assert got == {"x": "a", "y": "b"}, got
