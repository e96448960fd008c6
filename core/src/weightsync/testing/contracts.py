"""Contract tests shipped with core. Subclass one, fill in its factory, and pytest runs every test
against your component. Fixtures live on the classes, so no pytest plugin is needed. A contract test
may be overridden only with an xfail mark saying why (test_no_silent_overrides checks)."""

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
from weightsync.interfaces import Adapter, Encoding, Exporter
from weightsync.sync.pipeline import WeightSync
from weightsync.testing.contract_base import Contract
from weightsync.testing.peer_contract import PeerSourceContract, ServingPeer
from weightsync.testing.sample import perturb, sample_state_dict


class ExporterContract(Contract, abc.ABC):
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


class EncodingContract(Contract, abc.ABC):
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


class AdapterContract(Contract, abc.ABC):
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

    def _config(self, engine: EngineSpec) -> dict[str, Any]:
        """A sync config that pushes to `engine` through this adapter and transport."""
        a = self.make_adapter(engine)
        return {"adapter": {"kind": a.name, "options": a.options.model_dump()},
                "transport": {"kind": self.transport, "options": self.transport_options},
                "engines": [engine.model_dump(exclude_none=True)]}

    def test_push_commits_version(self, engine: EngineSpec) -> None:
        sd = perturb(self.make_model(), 1)
        with WeightSync.from_config(self._config(engine)) as sync:
            report = sync.push(sd, version=1)
        assert report.ok, report.summary()
        assert self.make_adapter(engine).health().version == 1
        got = self.read_weights(engine, list(sd))
        if got is not None:
            for n, t in sd.items():
                assert torch.equal(got[n], t), n

    def test_failed_round_keeps_version(self, engine: EngineSpec) -> None:
        bad = {"no.such.tensor": torch.zeros(3)}
        with WeightSync.from_config(self._config(engine)) as sync, pytest.raises(SyncError):
            sync.push(bad, version=1)
        assert self.make_adapter(engine).health().version == 0


__all__ = ["AdapterContract", "EncodingContract", "ExporterContract", "PeerSourceContract",
           "ServingPeer"]
