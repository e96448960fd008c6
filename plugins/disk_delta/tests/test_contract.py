"""Core's contract kit, run against this plugin's components."""

from pathlib import Path

import pytest
from safetensors.torch import save_file

from weightsync.wire.bucket import Bucket
from weightsync.interfaces import Encoding, Transport
from weightsync.testing.contracts import EncodingContract
from weightsync_reference.contracts import TransportContract
from weightsync.testing.sample import sample_state_dict
from weightsync_disk_delta.encoding import DeltaEncoding
from weightsync_disk_delta.transport import DiskDeltaTransport


class TestDeltaEncodingFirstFull(EncodingContract):
    def make_encoding(self) -> Encoding:
        return DeltaEncoding()


class TestDeltaEncodingSeeded(EncodingContract):
    """Seeded from the receiver's current tensors, so real deltas travel."""

    @pytest.fixture(autouse=True)
    def _base(self, tmp_path: Path) -> None:
        self.base_dir = tmp_path / "base"
        self.base_dir.mkdir()
        save_file({n: t.contiguous() for n, t in sample_state_dict(seed=99).items()},
                  str(self.base_dir / "model.safetensors"))

    def make_encoding(self) -> Encoding:
        return DeltaEncoding(DeltaEncoding.Options(base_checkpoint=str(self.base_dir)))

    def make_bucket(self) -> Bucket:
        """The receiver's tensors with every 20th element changed: sparse deltas."""
        sd = sample_state_dict(seed=99)
        for t in sd.values():
            if t.is_floating_point() and t.numel():
                t.view(-1)[::20] += 1
        return Bucket(0, list(sd.items()), last=True)

    def test_deltas_travel(self) -> None:
        enc = self.make_encoding()
        enc.begin(1)
        payload = enc.encode(self.make_bucket())
        kinds = {e["kind"] for e in payload.meta["tensors"].values()}
        assert "sparse" in kinds and payload.meta["kind"] == "delta"


class TestDiskDeltaTransport(TransportContract):
    def make_transport(self, tmp_path: Path) -> Transport:
        return DiskDeltaTransport(DiskDeltaTransport.Options(root=str(tmp_path / "root")))
