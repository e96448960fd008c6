"""A relay that misbehaves costs at most one `stall` per push, never the push: after it stalls
feeding a child, or a child refuses what it forwarded, it is planned as a leaf for the rest of
the push and benched from relaying for later pushes (one, then twice as many after each further
strike). Real reference engines on loopback; the misbehaving member runs a program of its own
(tests/trickling_relay.py, tests/stale_relay.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync import WeightSync
from weightsync.testing.sample import perturb, write_weights_only_model
from weightsync_reference.processes import EngineProcess, running

HERE = Path(__file__).resolve().parent
TENSOR = 4096                # fp32 elements: 16 KiB, one bucket each
BUCKETS = 60


def chain(engines: list[EngineProcess], deadline: float, stall: float) -> dict[str, Any]:
    return {"adapter": "reference", "engines": [e.spec() for e in engines],
            "transport": {"kind": "http", "options": {"shape": "chain", "piece_bytes": 4096,
                                                       "stall": stall}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": TENSOR * 4}},
            "sync": {"progress": "off", "deadline": deadline, "failure_policy": "continue"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(TENSOR, generator=g) for i in range(BUCKETS)}
    return write_weights_only_model(tmp_path_factory.mktemp("strikes") / "model", sd), sd


@pytest.fixture
def fleet(model: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, request: Any
          ) -> Iterator[list[EngineProcess]]:
    """Four engines; e1 runs `request.param` (a misbehaving relay)."""
    with running(model[0], tmp_path, 4, {1: [sys.executable, str(HERE / request.param)]}) as engines:
        yield engines


@pytest.mark.parametrize("fleet", ["trickling_relay.py"], indirect=True)
def test_a_trickling_relay_costs_one_stall_per_push_not_the_push(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """e1 forwards the first piece of every bucket and then a byte a second. At 60 buckets and
    `stall` a twentieth of the deadline (the defaults' ratio), a stall per bucket would cost
    three deadlines: instead e2 gives up on e1 once, e1 becomes a leaf, and every engine,
    e1 included (it received every byte from e0), commits the version within the deadline,
    e1 named in the report. The next push benches e1 (no stall at all); the one after tries
    it again, and a second strike benches it for two pushes."""
    cfg = chain(fleet, deadline=40.0, stall=2.0)
    with WeightSync.from_config(cfg) as sync:
        new = perturb(model[1], 1)
        report = sync.push(new, version=1)
        assert report.ok and report.verified, report.summary()
        assert report.buckets >= 56, report.buckets
        assert report.seconds["total"] < 40.0, report.seconds
        remark = report.engines["e1"].remark
        assert remark is not None and "it stalled feeding e2" in remark \
            and "the next 1 push" in remark, report.summary()
        assert "e1:" in report.summary()
        events = sync.transport.relay_events
        stalls = [x for x in events if x.startswith("bucket") and "relay e1 stalled" in x]
        assert 1 <= len(stalls) <= 2, events            # the buckets in flight when it stalled
        # e2, starved by e1, stalls its own child too: that is not e2's strike
        assert [x for x in events if "demoted" in x] == \
            [x for x in events if "relay e1 demoted to a leaf: it stalled feeding e2" in x], events
        assert report.engines["e2"].remark is None, report.summary()
        for e in fleet:
            assert e.health()["version"] == 1 and e.holds(new), e.name

        new = perturb(new, 2)                           # benched: a leaf, nobody stalls
        report = sync.push(new, version=2)
        assert report.ok and report.verified, report.summary()
        assert "relay benched (strike 1" in (report.engines["e1"].remark or ""), report.summary()
        assert not any("stalled" in x for x in sync.transport.relay_events), \
            sync.transport.relay_events
        for e in fleet:
            assert e.health()["version"] == 2 and e.holds(new), e.name

        new = perturb(new, 3)                           # tried again: strike 2, two pushes out
        report = sync.push(new, version=3)
        assert report.ok and report.verified, report.summary()
        assert "the next 2 pushes" in (report.engines["e1"].remark or ""), report.summary()
        for e in fleet:
            assert e.health()["version"] == 3 and e.holds(new), e.name


@pytest.mark.parametrize("fleet", ["stale_relay.py"], indirect=True)
def test_a_relay_that_forwards_the_last_versions_frames_is_named(
        fleet: list[EngineProcess], model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """e1 relays v1 honestly, then forwards v1's frames (well formed, every piece matching v1's
    digests) in the push of v2: e2 refuses the header before any body byte, says so signed, and
    the trainer names e1, which keeps v1; every other engine commits v2."""
    with WeightSync.from_config(chain(fleet, deadline=60.0, stall=2.0)) as sync:
        v1 = perturb(model[1], 1)
        assert sync.push(v1, version=1).verified
        v2 = perturb(v1, 2)
        report = sync.push(v2, version=2)
        events = sync.transport.relay_events
    bad = report.engines["e1"]
    assert not bad.ok and bad.stage == "send", report.summary()
    assert "header from relay e1 is not the one the trainer announced" in (bad.error or ""), bad.error
    assert any("e2 refused bytes relayed by e1" in x for x in events), events
    assert fleet[1].health()["version"] == 1 and fleet[1].holds(v1)
    for e in (fleet[0], fleet[2], fleet[3]):
        assert report.engines[e.name].ok, report.summary()
        assert e.health()["version"] == 2 and e.holds(v2), e.name
