"""Relay shapes of the `http` transport (chain, tree) against real reference engines on loopback:
the trainer sends one copy to one member, members pass it on piece by piece, every hop checks
each piece against the digests the trainer announced, and whatever the tree does not deliver
(a dead relay, bytes a child refused) the trainer sends itself."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync import WeightSync
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import running
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

HERE = Path(__file__).resolve().parent
BUCKET = 64 << 10            # several buckets per push
PIECE = 4096                 # many pieces per bucket


def config(engines: list[EngineProcess], shape: str, degree: int = 2, encoding: str | None = None,
           **sync: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "adapter": "reference", "engines": [e.spec() for e in engines],
        "transport": {"kind": "http", "options": {"shape": shape, "degree": degree,
                                                   "piece_bytes": PIECE}},
        "exporter": {"kind": "torch", "options": {"bucket_bytes": BUCKET}},
        "sync": {"progress": "off", "deadline": 60, **sync}}
    if encoding is not None:
        cfg["encoding"] = {"kind": encoding}
    return cfg


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = sample_state_dict(scale=2)
    return write_weights_only_model(tmp_path_factory.mktemp("relay") / "model", sd), sd


@pytest.fixture
def fleet(model: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, request: Any
          ) -> Iterator[list[EngineProcess]]:
    """Five engines, or `request.param`: (how many, the program e0 runs)."""
    n, program = getattr(request, "param", (5, None))
    with running(model[0], tmp_path, n, {0: program} if program else None) as engines:
        yield engines


@pytest.mark.parametrize("shape,degree,encoding", [("chain", 1, None), ("tree", 2, None),
                                                   ("chain", 1, "delta"), ("tree", 3, "delta")])
def test_a_push_reaches_every_member_through_the_members(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]], shape: str,
        degree: int, encoding: str | None) -> None:
    from weightsync.plugins import load_components
    if encoding and encoding not in load_components().encodings:
        pytest.skip(reason=f"no {encoding!r} encoding is registered (its plugin is not installed)")
    sd = model[1]
    with WeightSync.from_config(config(fleet, shape, degree, encoding)) as sync:
        for v in (1, 2):
            new = perturb(sd, v)
            report = sync.push(new, version=v)
            assert report.ok and report.verified, report.summary()
            assert sync.transport.relay_events == [], sync.transport.relay_events
            for e in fleet:
                assert e.health()["version"] == v and e.holds(new), f"{e.name} at v{v}"
            sd = new
    relay = {e.name: e.health()["relay"] for e in fleet}
    buckets = report.buckets
    assert relay["e0"]["received"] == 2 * buckets      # the root: every bucket from the trainer
    for e in fleet[1:]:                                  # the others: every bucket from a member
        assert relay[e.name]["received"] == 2 * buckets, relay
    for e in fleet:                  # raw bytes are staged as they arrive, deltas once whole
        assert relay[e.name]["streamed"] == (relay[e.name]["received"] if encoding is None else 0)
    forwarded = sum(r["forwarded"] for r in relay.values())
    assert forwarded == 2 * buckets * (len(fleet) - 1), relay   # each member fed exactly once
    if shape == "chain":
        assert all(relay[e.name]["forwarded"] == 2 * buckets for e in fleet[:-1]), relay


@pytest.mark.parametrize("fleet", [(4, [sys.executable, str(HERE / "tampering_relay.py")])],
                         indirect=True)
def test_a_relay_that_tampers_is_refused_by_its_child_and_blamed(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """e0 forwards every piece with one bit flipped: e1 refuses it (nothing of the bucket is
    staged or forwarded), the trainer feeds e1.. itself, and e0 is reported, not committed."""
    new = perturb(model[1], 1)
    with WeightSync.from_config(config(fleet, "chain", failure_policy="continue")) as sync:
        report = sync.push(new, version=1)
        events = sync.transport.relay_events
    bad = report.engines["e0"]
    assert not bad.ok and bad.stage == "send" and "do not match the digests" in bad.error, \
        report.summary()
    assert any("e1 refused bytes relayed by e0" in x for x in events), events
    assert fleet[0].health()["version"] == 0 and fleet[0].holds(model[1])
    for e in fleet[1:]:
        assert report.engines[e.name].ok, report.summary()
        assert e.health()["version"] == 1 and e.holds(new), e.name


@pytest.mark.parametrize("fleet", [(4, [sys.executable, str(HERE / "stalling_relay.py")])],
                         indirect=True)
def test_a_relay_that_stalls_costs_its_subtree_nothing(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """e0 (the chain's root) stops feeding e1 mid-bucket but stays up: e1 gives up on the relay
    after `stall` seconds and says so to the trainer, which feeds it itself; e2 and e3 stall
    too, or see their relay's body end when the member above them lets go of the bucket for
    the trainer's copy. Every member commits the version bit for bit, and the stall is
    reported by relay and member. e0 is then a leaf for the rest of the push and the next."""
    new = perturb(model[1], 1)
    cfg = config(fleet, "chain")
    cfg["transport"]["options"]["stall"] = 2.0
    with WeightSync.from_config(cfg) as sync:
        report = sync.push(new, version=1)
        events = sync.transport.relay_events
        assert report.ok and report.verified, report.summary()
        assert any("relay e0 stalled feeding e1" in x for x in events), events
        assert any("e1 fed directly by the trainer (stalled: relay e0" in x for x in events), events
        for n in ("e2", "e3"):
            assert any(f"{n} fed directly by the trainer (" in x and (
                "stalled: relay" in x or "the relayed body ended" in x) for x in events), events
        assert "it stalled feeding e1" in (report.engines["e0"].remark or ""), report.summary()
        for e in fleet:
            assert e.health()["version"] == 1 and e.holds(new), e.name
        newer = perturb(new, 2)                     # e0 sits this one out as a leaf: no stall
        report = sync.push(newer, version=2)
        assert report.ok and report.verified, report.summary()
        assert sync.transport.relay_events == [], sync.transport.relay_events
        assert "relay benched" in (report.engines["e0"].remark or ""), report.summary()
        for e in fleet:
            assert e.health()["version"] == 2 and e.holds(newer), e.name


@pytest.mark.parametrize("fleet", [(6, None)], indirect=True)
def test_a_relay_killed_at_random_moments_costs_no_survivor_a_mixed_version(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Ten pushes through a tree of six; in each, a relay is killed while the exporter is at a
    random tensor. Every survivor ends at the new version bit for bit, or at its old one with a
    reason in the report, never a mix; the dead relay is reported by name and stage."""
    rng = random.Random(7)
    old = model[1]
    names = list(old)
    version = 0
    held = {e.name: old for e in fleet}
    fed = 0                                             # trials where the trainer stepped in
    with WeightSync.from_config(config(fleet, "tree", 2, failure_policy="continue")) as sync:
        for trial in range(10):
            victim = fleet[rng.choice([0, 1, 2])]       # the inner members of the tree
            at = rng.randrange(len(names))
            version += 1
            new = perturb(old, version)

            def export(at: int = at, victim: EngineProcess = victim) -> Iterator[Any]:
                for i, n in enumerate(names):
                    if i == at:
                        victim.kill()
                    yield n, new[n]
            report = sync.push(export(), version=version)
            fed += any("fed directly" in x for x in sync.transport.relay_events)
            dead = report.engines[victim.name]
            assert not dead.ok and dead.stage and dead.error, report.summary()
            for e in fleet:
                if e is victim:
                    continue
                o = report.engines[e.name]
                v = e.health()["version"]
                if o.ok:
                    assert v == version and e.holds(new), f"trial {trial}: {e.name}"
                    held[e.name] = new
                else:
                    assert o.error and v < version and e.holds(held[e.name]), \
                        f"trial {trial}: {e.name}: {o}"
            victim.start(timeout=120)                   # back at version 0, its first weights
            assert victim.health()["version"] == 0
            held[victim.name] = model[1]
            old = new
    assert fed >= 1, "no trial needed the trainer's direct send: the kills never hit a relay"


@pytest.mark.parametrize("fleet", [(1, None)], indirect=True)
def test_relay_routes_refuse_what_the_trainer_did_not_announce(fleet: list[EngineProcess]) -> None:
    """No relay token, a wrong one, or a bucket never announced: refused, nothing staged; a
    malformed announcement says what it lacks."""
    import requests
    e = fleet[0]
    plan = {"version": 1, "transport": {"kind": "http"}, "encoding": {"kind": "raw"}}
    rid = requests.post(e.url + "/weightsync/begin", json=plan, timeout=10).json()["round"]
    hdr = {"X-Weightsync-Round": rid}
    r = requests.post(e.url + "/weightsync/relay", data=b"x" * 64, headers=hdr, timeout=10)
    assert r.status_code == 400 and "relay token" in r.json()["error"], r.text
    expect = e.url + "/weightsync/deliver"
    r = requests.post(expect, json={"kind": "http.expect", "body": {"index": 0}}, headers=hdr,
                      timeout=10)
    assert r.status_code == 400 and "malformed" in r.json()["error"], r.text
    good = {"index": 0, "header": {"index": 0, "nbytes": 5000}, "pieces": ["a", "b"],
            "piece_bytes": 4096, "name": e.name, "ack_key": "k" * 32, "token": "t" * 32}
    r = requests.post(expect, json={"kind": "http.expect", "body": good}, headers=hdr, timeout=10)
    assert r.status_code == 200, r.text
    r = requests.post(e.url + "/weightsync/relay", data=b"x" * 64,
                      headers={**hdr, "X-Weightsync-Relay": "u" * 32}, timeout=10)
    assert r.status_code == 400 and "relay token" in r.json()["error"], r.text
    from weightsync.wire.frame import frame
    body = b"".join(bytes(p) for p in frame({"index": 3, "nbytes": 4}, b"abcd"))
    r = requests.post(e.url + "/weightsync/relay", data=body,
                      headers={**hdr, "X-Weightsync-Relay": "t" * 32}, timeout=10)
    assert r.status_code == 400 and "announced no bucket 3" in r.json()["error"], r.text
    assert e.health()["relay"]["received"] == 0
