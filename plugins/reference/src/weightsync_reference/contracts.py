"""The contracts that need real receivers: a transport pushes through reference-engine
processes, a fleet source adds and removes reference engines as members. A plugin subclasses them
in a few lines (the rest of the kit is core's `weightsync.testing`):

    from weightsync_reference.contracts import TransportContract

    class TestMyTransport(TransportContract):
        def make_transport(self, tmp_path):
            return MyTransport(MyTransport.Options())
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync import Transport, WeightSync
from weightsync.errors import SyncError
from weightsync.net.server import free_port
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model
from weightsync.testing.contract_base import Contract
from weightsync_reference.processes import EngineProcess, start_all

__all__ = ["FleetContract", "TransportContract"]


class TransportContract(Contract, abc.ABC):
    """Pushes through real reference-engine processes (weights-only models)."""

    adapter = "reference"
    engines_count = 2

    @abc.abstractmethod
    def make_transport(self, tmp_path: Path) -> Transport: ...

    def config(self, transport: Transport, engines: list[EngineProcess]) -> dict[str, Any]:
        return {"transport": transport.describe(transport.options), "adapter": self.adapter,
                "engines": [e.spec() for e in engines],
                "exporter": {"kind": "torch", "options": {"bucket_bytes": 8192}},
                "sync": {"failure_policy": "continue"}}

    @pytest.fixture
    def transport(self, tmp_path: Path) -> Transport:
        return self.make_transport(tmp_path)

    @pytest.fixture
    def engines(self, tmp_path: Path, transport: Transport) -> Iterator[list[EngineProcess]]:
        if transport.publish_only:
            pytest.skip(reason="publish-only transports are checked by their pull agent's tests")
        model = write_weights_only_model(tmp_path / "model", sample_state_dict())
        procs = [EngineProcess(model, log=tmp_path / f"engine{i}.log") for i in range(self.engines_count)]
        try:
            start_all(procs)
            yield procs
        finally:
            for p in procs:
                p.stop()

    def test_receiving_half_exists(self, transport: Transport) -> None:
        assert transport.publish_only or transport.receiver is not None

    def test_three_versions_bit_exact(self, transport: Transport, engines: list[EngineProcess]) -> None:
        sd = sample_state_dict()
        with WeightSync.from_config(self.config(transport, engines)) as sync:
            for v in (1, 2, 3):
                sd = perturb(sd, v)
                report = sync.push(sd, version=v)
                assert report.ok and report.verified, report.summary()
                for e in engines:
                    assert e.health()["version"] == v
                    got = e.weights()
                    for n, t in sd.items():
                        assert torch.equal(got[n], t), f"{e.name}: {n} differs after version {v}"

    def test_unreachable_engine_fails_only_itself(self, transport: Transport,
                                                  engines: list[EngineProcess]) -> None:
        cfg = self.config(transport, engines[:1])
        cfg["engines"].append({"url": f"http://127.0.0.1:{free_port()}", "name": "ghost"})
        sd = perturb(sample_state_dict(), 5)
        with WeightSync.from_config(cfg) as sync:
            report = sync.push(sd, version=1)
        assert report.engines["ghost"].ok is False and report.engines["ghost"].stage == "health"
        assert report.engines[engines[0].name].ok and engines[0].health()["version"] == 1


class FleetContract(Contract, abc.ABC):
    """For fleet sources whose members join and leave at run time (a registry, Ray, a third
    party's Kubernetes). A subclass gives the config of its fleet and says how a member joins and
    leaves it; every test runs a real reference engine as the member and a real WeightSync."""

    settle = 15.0                                # seconds a join or leave may take to show

    @abc.abstractmethod
    def fleet_config(self, tmp_path: Path) -> dict[str, Any]:
        """The `fleet:` entry of a SyncConfig ({"kind": ..., "options": ...})."""

    @abc.abstractmethod
    def add_member(self, sync: WeightSync, name: str, engine: EngineProcess) -> None:
        """Make `engine` a member named `name` of `sync.fleet`."""

    @abc.abstractmethod
    def remove_member(self, sync: WeightSync, name: str) -> None:
        """Make member `name` leave."""

    @pytest.fixture
    def engine(self, tmp_path: Path) -> Iterator[EngineProcess]:
        model = write_weights_only_model(tmp_path / "model", sample_state_dict())
        with EngineProcess(model, log=tmp_path / "member.log") as e:
            yield e

    @pytest.fixture
    def sync(self, tmp_path: Path) -> Iterator[WeightSync]:
        cfg = {"fleet": self.fleet_config(tmp_path), "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
        with WeightSync.from_config(cfg) as s:
            yield s

    def _wait(self, cond: Any, what: str) -> None:
        import time
        deadline = time.monotonic() + self.settle
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"{what} within {self.settle}s")

    def test_a_member_that_joins_is_pushed_to(self, sync: WeightSync, engine: EngineProcess) -> None:
        assert sync.fleet.members() == []
        self.add_member(sync, "m1", engine)
        self._wait(lambda: [m.name for m in sync.fleet.members()] == ["m1"], "the member did not appear")
        m = sync.fleet.members()[0]
        assert m.spec.url.rstrip("/") == engine.url and m.spec.name == "m1"
        json.dumps(m.spec.model_dump(mode="json"))          # a member is plain data
        sd = perturb(sample_state_dict(), 1)
        report = sync.push(sd, version=1)
        assert report.ok and list(report.engines) == ["m1"] and report.engines["m1"].version == 1
        got = engine.weights()
        assert all(torch.equal(got[n], t) for n, t in sd.items())

    def test_a_member_that_leaves_is_not_pushed_to(self, sync: WeightSync, engine: EngineProcess) -> None:
        self.add_member(sync, "m1", engine)
        self._wait(lambda: len(sync.fleet.members()) == 1, "the member did not appear")
        assert sync.push(perturb(sample_state_dict(), 1), version=1).ok
        self.remove_member(sync, "m1")
        self._wait(lambda: sync.fleet.members() == [], "the member did not leave")
        with pytest.raises(SyncError, match="no engine could take the sync"):
            sync.push(perturb(sample_state_dict(), 2), version=2)
        assert engine.health()["version"] == 1

    def test_names_stay_unique(self, sync: WeightSync, engine: EngineProcess, tmp_path: Path) -> None:
        self.add_member(sync, "m1", engine)
        self._wait(lambda: len(sync.fleet.members()) == 1, "the member did not appear")
        other = EngineProcess(engine.model_dir, log=tmp_path / "other.log").start()
        try:
            try:
                self.add_member(sync, "m1", other)       # refused, or it replaces the first
            except Exception:  # noqa: BLE001 - a refusal is a valid answer
                pass
            # never two members of one name (the first may have lapsed meanwhile on a loaded
            # machine: a fleet that keeps names bound then refuses the second, and has none)
            names = [m.name for m in sync.fleet.members()]
            assert names.count("m1") <= 1, names
        finally:
            other.stop()

    def test_synced_and_excluded_are_plain(self, sync: WeightSync) -> None:
        sync.fleet.synced(3, {"nobody": 3})
        assert isinstance(sync.fleet.excluded(), dict)
        json.dumps(sync.fleet.excluded())
