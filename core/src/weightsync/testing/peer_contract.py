"""The contract of a peer source (how a joining member fetches a current member's weights): a
plugin that registers one through `register_peer_sources` subclasses PeerSourceContract."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.wire.bucket import digest_tensors, dtype_name
from weightsync.errors import PayloadError
from weightsync.fleets.peer import PeerManifest, parse_manifest
from weightsync.interfaces import PeerSource
from weightsync.testing.contract_base import Contract


@dataclass
class ServingPeer:
    """A member serving its weights to joiners: `share()` opens a fresh share and returns what the
    registry would hand a joiner (url, token, source); `weights`, `version`: what it holds."""

    share: Callable[[], dict[str, Any]]
    weights: dict[str, torch.Tensor]
    version: int


class PeerSourceContract(Contract, abc.ABC):
    """For peer sources (how a joining member fetches a current member's weights). A subclass
    gives the source and a serving member; every test opens a share of its own on that member,
    which serves for the whole class."""

    @abc.abstractmethod
    def make_source(self) -> PeerSource: ...

    @abc.abstractmethod
    def serving_peer(self, tmp_path: Path) -> Iterator[ServingPeer]:
        """Generator: start a member with weights at a version > 0, yield a ServingPeer, stop it."""

    @pytest.fixture(scope="class")
    @classmethod
    def peer(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingPeer]:
        """One serving member for the whole class (a process start, not one per test)."""
        yield from cls().serving_peer(tmp_path_factory.mktemp("peer"))

    @pytest.fixture
    def source(self) -> PeerSource:
        return self.make_source()

    @staticmethod
    def _share(source: PeerSource, peer: ServingPeer) -> tuple[dict[str, Any], PeerManifest]:
        """A fresh share, naming the version of its manifest (read with it), and that manifest."""
        share = peer.share()
        man = parse_manifest(source.manifest(share))
        return {**share, "version": man.version}, man

    def test_manifest_names_the_version_and_every_tensor(self, source: PeerSource,
                                                         peer: ServingPeer) -> None:
        _, man = self._share(source, peer)
        assert man.version == peer.version
        listed = {t.name: t for b in man.buckets for t in b.tensors}
        assert set(listed) == set(peer.weights)
        for n, t in peer.weights.items():
            assert listed[n].shape == list(t.shape), n
            assert listed[n].dtype == dtype_name(t.dtype), n
        assert all(b.digest for b in man.buckets)

    def test_every_bucket_matches_its_digest_and_the_weights(self, source: PeerSource,
                                                             peer: ServingPeer) -> None:
        from weightsync.wire.frame import unpack
        share, man = self._share(source, peer)
        seen: set[str] = set()
        for b in man.buckets:
            header, body = source.bucket(share, b.index)
            assert header["index"] == b.index and header["digest"] == b.digest
            assert int(header["version"]) == man.version
            tensors, _ = unpack(body)
            assert [n for n, _ in tensors] == [t.name for t in b.tensors]
            assert digest_tensors(tensors) == b.digest, f"bucket {b.index} hashes to another digest"
            for n, t in tensors:
                assert torch.equal(t, peer.weights[n]), f"{n} differs from the peer's weights"
                seen.add(n)
        assert seen == set(peer.weights)

    def test_a_wrong_token_is_refused(self, source: PeerSource, peer: ServingPeer) -> None:
        share = {**peer.share(), "token": "not-a-token-the-peer-opened-" + "x" * 8}
        with pytest.raises(PayloadError, match="token"):
            source.manifest(share)

    def test_a_token_serves_one_pull(self, source: PeerSource, peer: ServingPeer) -> None:
        share, man = self._share(source, peer)
        for b in man.buckets:
            source.bucket(share, b.index)
        with pytest.raises(PayloadError, match="token"):
            source.manifest(share)
        with pytest.raises(PayloadError, match="token"):
            source.bucket(share, 0)

    def test_an_index_outside_the_manifest_fails_clearly(self, source: PeerSource,
                                                         peer: ServingPeer) -> None:
        share, man = self._share(source, peer)
        with pytest.raises(PayloadError, match=f"bucket {len(man.buckets)}"):
            source.bucket(share, len(man.buckets))
