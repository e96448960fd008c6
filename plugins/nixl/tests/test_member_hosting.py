"""Fleet members that serve joiners from their own registered memory (`weightsync serve
--share-source nixl`): the engine publishes the version it holds into NIXL-registered memory when
a share asks for it, a joiner READs every bucket one-sided, and the engine withdraws that memory
whenever its weights change. Real reference engines on loopback (UCX over TCP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

import torch  # noqa: E402

from weightsync import EngineError, WeightSync  # noqa: E402
from weightsync.config import EngineSpec  # noqa: E402
from weightsync.fleets.peer import new_token  # noqa: E402
from weightsync.plugins import load_components  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync.testing.waiting import wait_for  # noqa: E402
from weightsync_reference.adapter import ReferenceAdapter  # noqa: E402
from weightsync_reference.processes import EngineProcess, start_all  # noqa: E402

from weightsync_nixl.testing import anchor  # noqa: E402

HOSTING = ["--share-source", "nixl"]
ENV = {"WEIGHTSYNC_NIXL_PEER_TIMEOUT": "10", "WEIGHTSYNC_NIXL_PEER_BUCKET_BYTES": str(64 << 10)}

if "delta" not in load_components().encodings:
    pytest.skip(reason="no 'delta' encoding is registered (its plugin is not installed)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = sample_state_dict(scale=2)
    return write_weights_only_model(tmp_path_factory.mktemp("hosting") / "model", sd), sd


@pytest.fixture
def fleet(base: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Iterator[list[EngineProcess]]:
    engines = [EngineProcess(base[0], name=f"e{i}", log=tmp_path / f"e{i}.log", env=ENV,
                             extra_args=HOSTING) for i in range(3)]
    start_all(engines, timeout=120)
    try:
        yield engines
    finally:
        for e in engines:
            e.stop()


def config(engines: list[EngineProcess], shape: str = "chain", encoding: str = "delta") -> dict[str, Any]:
    return {"adapter": "reference", "engines": [e.spec() for e in engines],
            "transport": {"kind": "http", "options": {"shape": shape}},
            "encoding": {"kind": encoding, **({"options": {"full_when_chain_exceeds": 0}}
                                              if encoding == "delta" else {})},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 64 << 10}},
            "sync": {"progress": "off", "deadline": 60, "failure_policy": "continue"}}


def adapter(e: EngineProcess) -> ReferenceAdapter:
    return ReferenceAdapter(engine=EngineSpec(**e.spec()))


def test_a_restarted_member_reads_the_version_from_a_members_registered_memory(
        fleet: list[EngineProcess], base: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Delta over a chain: e1 restarts (no delta base), the push's peer join has it pull the
    new version from a current member, one-sided over NIXL, checked against the push's digests."""
    sd = base[1]
    with WeightSync.from_config(config(fleet)) as sync:
        for v in (1, 2):
            sd = perturb(sd, v)
            assert sync.push(sd, version=v).verified
        fleet[1].stop()
        fleet[1].start(timeout=120)
        assert fleet[1].health()["version"] == 0
        sd = perturb(sd, 3)
        report = sync.push(sd, version=3)
        assert report.ok and report.verified, report.summary()
        joiner = report.engines["e1"]
        assert joiner.caught_up and joiner.peer_error is None and joiner.status == "verified", joiner
        peer = next(e for e in fleet if e.name == joiner.peer)
        health = {e.name: e.health() for e in fleet}
        assert health["e1"]["peer"]["pulled"] == 1 and health["e1"]["peer"]["from"] == peer.url
        served = health[peer.name]["peer"]
        assert served["source"] == "nixl" and served["hosting"]["buckets"] > 1, served
        assert served["served_buckets"] == 0, served          # not one bucket over HTTP
        # the joiner's "read" notifications reach the peer after its pull returned
        wait_for(lambda: peer.health()["peer"]["hosting"]["reads"] == served["hosting"]["buckets"],
                 30, "the peer to count every bucket read one-sided")
        for e in fleet:
            assert health[e.name]["version"] == 3 and e.holds(sd), e.name
        # the next commit withdraws what the peer published: it serves no stale version
        sd = perturb(sd, 4)
        report = sync.push(sd, version=4)
        assert report.ok and not any(o.caught_up for o in report.engines.values())
        assert peer.health()["peer"]["hosting"]["version"] is None


def test_a_share_of_a_version_the_member_moved_on_from_fails_cleanly(
        fleet: list[EngineProcess], base: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """A share opened at v1, the member then commits v2 (its registered v1 is withdrawn): the
    joiner's pull fails saying so and leaves it on its version; a fresh share then serves v2."""
    host, joiner = fleet[0], fleet[2]
    sd1, sd2 = perturb(base[1], 1), perturb(base[1], 2)
    a, j = adapter(host), adapter(joiner)
    try:
        with WeightSync.from_config(config([host], "star", "raw")) as sync:
            assert sync.push(sd1, version=1).verified
            token = new_token()
            assert a.share(token, 60) == {"version": 1, "source": "nixl"}
            assert host.health()["peer"]["hosting"]["version"] == 1
            assert sync.push(sd2, version=2).verified
        with pytest.raises(EngineError, match=f"pull from peer {host.url} failed: .*HTTP 409.*"
                                              f"serves no version now.*stays at version 0"):
            j.pull({"url": host.url, "token": token, "source": "nixl", "anchor": anchor(sd1, 1)})
        h = joiner.health()
        assert h["version"] == 0 and h["round"] is None and h["peer"]["pulled"] == 0, h
        token = new_token()
        assert a.share(token, 60)["version"] == 2
        assert j.pull({"url": host.url, "token": token, "source": "nixl",
                       "anchor": anchor(sd2, 2)}) == 2
        assert joiner.holds(sd2)
        buckets = host.health()["peer"]["hosting"]["buckets"]
        assert buckets > 1
        wait_for(lambda: host.health()["peer"]["hosting"]["reads"] == buckets, 30,
                 "the host to count every bucket read one-sided")
    finally:
        a.close()
        j.close()


def test_an_unknown_share_source_stops_the_engine_with_what_it_knows(
        base: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    e = EngineProcess(base[0], name="bad", log=tmp_path / "bad.log", extra_args=["--share-source",
                                                                                  "carrier-pigeon"])
    with pytest.raises(RuntimeError, match=r"exited with 2 during start.*\n.*error: unknown peer "
                                           r"source 'carrier-pigeon'; installed: \['http', 'nixl'\]"):
        e.start(timeout=60)
    e.stop()
