"""The contract kit against transport `nixl` (real reference-engine processes, which load this
plugin through its entry point) and peer source `nixl` (a real peer host process)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

from weightsync.interfaces import PeerSource, Transport  # noqa: E402
from weightsync.testing import PeerSourceContract, ServingPeer  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync_reference.contracts import TransportContract  # noqa: E402

from weightsync_nixl.peer_source import NixlPeerSource  # noqa: E402
from weightsync_nixl.sending import NixlTransport  # noqa: E402
from weightsync_nixl.testing import PeerProcess  # noqa: E402


class TestNixlTransport(TransportContract):
    def make_transport(self, tmp_path: Path) -> Transport:
        return NixlTransport(NixlTransport.Options(device="cpu"))


class TestNixlPeerSource(PeerSourceContract):
    def make_source(self) -> PeerSource:
        return NixlPeerSource()

    def serving_peer(self, tmp_path: Path) -> Iterator[ServingPeer]:
        weights = perturb(sample_state_dict(), 3)
        model = write_weights_only_model(tmp_path / "model", weights)
        with PeerProcess(model, 3, tmp_path / "peer.log", bucket_bytes=4096) as peer:
            yield ServingPeer(share=peer.share, weights=weights, version=3)
