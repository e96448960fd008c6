"""Contract tests shipped with core. Subclass one, fill in its factory, and pytest runs every
test against your component. Fixtures live on the classes, so no pytest plugin is needed.
Overriding a contract test is allowed only with an xfail mark that says why
(test_no_silent_overrides checks)."""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync.wire.bucket import Bucket, digest_tensors
from weightsync.config import EngineSpec
from weightsync.errors import PayloadError, SyncError
from weightsync.interfaces import Adapter, Encoding, Exporter, Transport
from weightsync.sync.pipeline import WeightSync
from weightsync.testing.contract_base import _Contract
from weightsync.testing.engines import EngineProcess, start_all
from weightsync.net.server import free_port
from weightsync.testing.peer_contract import PeerSourceContract, ServingPeer
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model


class ExporterContract(_Contract, abc.ABC):
    bucket_bytes = 4096

    @abc.abstractmethod
    def make_exporter(self, bucket_bytes: int) -> Exporter: ...

    def make_model(self) -> Any:
        return sample_state_dict()

    def expected(self, model: Any) -> dict[str, torch.Tensor]:
        """The named tensors the exporter must produce for `make_model()`."""
        return dict(model)

    @pytest.fixture
    def exported(self) -> list[Bucket]:
        return list(self.make_exporter(self.bucket_bytes).buckets(self.make_model()))

    def test_every_tensor_exported_once_bit_exact(self, exported: list[Bucket]) -> None:
        names = [n for b in exported for n in b.names]
        assert len(names) == len(set(names))
        want = self.expected(self.make_model())
        assert set(names) == set(want)
        for b in exported:
            for n, t in b.tensors:
                assert digest_tensors([(n, t)]) == digest_tensors([(n, want[n])]), n

    def test_buckets_respect_limit(self, exported: list[Bucket]) -> None:
        for b in exported:
            assert b.nbytes <= self.bucket_bytes or len(b.tensors) == 1, \
                f"bucket {b.index} holds {b.nbytes} bytes in {len(b.tensors)} tensors"

    def test_indices_consecutive_and_only_final_is_last(self, exported: list[Bucket]) -> None:
        assert [b.index for b in exported] == list(range(len(exported)))
        assert [b.last for b in exported] == [False] * (len(exported) - 1) + [True]


class EncodingContract(_Contract, abc.ABC):
    @abc.abstractmethod
    def make_encoding(self) -> Encoding: ...

    def make_bucket(self) -> Bucket:
        return Bucket(0, list(sample_state_dict().items()), last=True)

    def current(self, name: str) -> torch.Tensor | None:
        """What the receiver holds now (the base a delta applies to)."""
        return sample_state_dict(seed=99).get(name)

    @pytest.fixture
    def encoding(self) -> Encoding:
        enc = self.make_encoding()
        enc.begin(1)
        return enc

    def test_round_trip(self, encoding: Encoding) -> None:
        bucket = self.make_bucket()
        payload = encoding.encode(bucket)
        decoded = dict(encoding.decode(payload, self.current))
        assert set(decoded) == set(bucket.names)
        assert digest_tensors([(n, decoded[n]) for n in bucket.names]) == payload.digest
        if encoding.lossless:
            assert payload.digest == bucket.digest()
            for n, t in bucket.tensors:
                assert decoded[n].dtype == t.dtype and decoded[n].shape == t.shape
                assert torch.equal(decoded[n], t) or (t.is_floating_point() and
                                                      torch.equal(decoded[n].isnan(), t.isnan()))

    def test_header_is_plain_json(self, encoding: Encoding) -> None:
        payload = encoding.encode(self.make_bucket())
        header = json.loads(json.dumps(payload.header()))
        assert header["index"] == 0 and header["last"] is True
        assert header["encoding"] == encoding.name
        assert payload.body.dtype == torch.uint8 and payload.body.dim() == 1

    def test_flipped_byte_is_detected(self, encoding: Encoding) -> None:
        payload = encoding.encode(self.make_bucket())
        body = payload.body.clone()
        body[-1] ^= 0xFF
        payload.body = body
        try:
            decoded = dict(encoding.decode(payload, self.current))
        except (PayloadError, ValueError, RuntimeError):
            return
        names = [s.name for s in payload.specs]
        assert digest_tensors([(n, decoded[n]) for n in names]) != payload.digest


class TransportContract(_Contract, abc.ABC):
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


class AdapterContract(_Contract, abc.ABC):
    """Drives a live engine (or a protocol-faithful stand-in) through one adapter."""

    transport = "http"
    transport_options: dict[str, Any] = {}

    @abc.abstractmethod
    def start_engine(self, tmp_path: Path, model: dict[str, torch.Tensor]) -> tuple[EngineSpec, Any]:
        """Start an engine holding `model`; return its spec and a zero-argument stop function."""

    @abc.abstractmethod
    def make_adapter(self, spec: EngineSpec) -> Adapter: ...

    def read_weights(self, spec: EngineSpec, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The engine's live tensors, when it can show them (None: skip the bit-exact check)."""
        return None

    def make_model(self) -> dict[str, torch.Tensor]:
        return sample_state_dict()

    @pytest.fixture
    def engine(self, tmp_path: Path) -> Iterator[EngineSpec]:
        spec, stop = self.start_engine(tmp_path, self.make_model())
        try:
            yield spec
        finally:
            stop()

    def test_health_reports_initial_version(self, engine: EngineSpec) -> None:
        assert self.make_adapter(engine).health().version == 0

    def test_pause_and_resume(self, engine: EngineSpec) -> None:
        a = self.make_adapter(engine)
        a.pause(a.pause_modes[0])
        a.resume()
        assert a.health().version == 0

    def test_push_commits_version(self, engine: EngineSpec) -> None:
        a = self.make_adapter(engine)
        cfg = {"adapter": {"kind": a.name, "options": a.options.model_dump()},
               "transport": {"kind": self.transport, "options": self.transport_options},
               "engines": [engine.model_dump(exclude_none=True)]}
        sd = perturb(self.make_model(), 1)
        with WeightSync.from_config(cfg) as sync:
            report = sync.push(sd, version=1)
        assert report.ok, report.summary()
        assert self.make_adapter(engine).health().version == 1
        got = self.read_weights(engine, list(sd))
        if got is not None:
            for n, t in sd.items():
                assert torch.equal(got[n], t), n

    def test_failed_round_keeps_version(self, engine: EngineSpec) -> None:
        a = self.make_adapter(engine)
        cfg = {"adapter": {"kind": a.name, "options": a.options.model_dump()},
               "transport": {"kind": self.transport, "options": self.transport_options},
               "engines": [engine.model_dump(exclude_none=True)]}
        bad = {"no.such.tensor": torch.zeros(3)}
        with WeightSync.from_config(cfg) as sync, pytest.raises(SyncError):
            sync.push(bad, version=1)
        assert self.make_adapter(engine).health().version == 0


class FleetContract(_Contract, abc.ABC):
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
            names = [m.name for m in sync.fleet.members()]
            assert names.count("m1") == 1
        finally:
            other.stop()

    def test_synced_and_excluded_are_plain(self, sync: WeightSync) -> None:
        sync.fleet.synced(3, {"nobody": 3})
        assert isinstance(sync.fleet.excluded(), dict)
        json.dumps(sync.fleet.excluded())


__all__ = ["AdapterContract", "EncodingContract", "ExporterContract", "FleetContract",
           "PeerSourceContract", "ServingPeer", "TransportContract"]
