"""Peer join over NIXL: a reference engine at version 0 (the joiner, this plugin loaded through
its entry point) pulls version 3 one-sided from a peer host's registered memory, checked against
the trainer's digests. A peer that dies mid-read, memory deregistered under the reader, a READ
that never completes, and forged descriptors each end in a clear error with the joiner on its
old version; it then catches up from another peer."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

import threading  # noqa: E402

from weightsync import EngineError  # noqa: E402
from weightsync.config import EngineSpec  # noqa: E402
from weightsync.fleets.peer import new_token  # noqa: E402
from weightsync.net.server import free_port  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync_reference.adapter import ReferenceAdapter  # noqa: E402
from weightsync_reference.processes import EngineProcess  # noqa: E402

from weightsync_nixl.peer_host import PeerHost, serve_host  # noqa: E402
from weightsync_nixl.testing import PeerProcess, anchor  # noqa: E402

FAULTY = [sys.executable, str(Path(__file__).with_name("faulty_peer.py"))]
V = 3


@pytest.fixture(scope="module")
def weights() -> dict[str, Any]:
    return perturb(sample_state_dict(scale=8), V)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, weights: dict[str, Any]) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {"base": write_weights_only_model(d / "base", sample_state_dict(scale=8)),
            "current": write_weights_only_model(d / "current", weights)}


@pytest.fixture(scope="module")
def joiner(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("joiner") / "joiner.log"
    with EngineProcess(models["base"], name="joiner", log=log,
                       env={"WEIGHTSYNC_NIXL_PEER_TIMEOUT": "4"}) as e:
        yield e


def pull(joiner: EngineProcess, share: dict[str, Any], weights: dict[str, Any]) -> int:
    adapter = ReferenceAdapter(engine=EngineSpec(**joiner.spec()))
    try:
        return adapter.pull({**share, "anchor": anchor(weights, V)})
    finally:
        adapter.close()


def assert_unchanged(joiner: EngineProcess) -> None:
    h = joiner.health()
    assert h["version"] == 0 and h["round"] is None and h["paused"] is None, h


@pytest.mark.parametrize("mode, why", [
    ("kill", r"READ from agent ws-peer-\d+-\w+ (failed|could not start)|not done by the deadline"),
    ("withdraw", r"could not start|no registered memory|digest|corrupted"),
    ("stop", r"not done by the deadline"),
], ids=["dies", "deregisters", "stalls"])
def test_a_failing_peer_leaves_the_joiner_on_its_old_version(
        tmp_path: Path, models: dict[str, Path], weights: dict[str, Any], joiner: EngineProcess,
        mode: str, why: str) -> None:
    peer = PeerProcess(models["current"], V, tmp_path / "peer.log", bucket_bytes=4096,
                       program=FAULTY + [mode]).start()
    try:
        with pytest.raises(EngineError, match=f"pull from peer {peer.url} failed: .*({why})"):
            pull(joiner, peer.share(), weights)
        assert_unchanged(joiner)
    finally:
        if mode == "stop" and peer.server.proc is not None:
            peer.signal(__import__("signal").SIGCONT)
        peer.stop()


@pytest.mark.parametrize("forgery", ["unregistered", "another bucket"])
def test_forged_descriptors_are_refused(models: dict[str, Path], weights: dict[str, Any],
                                        joiner: EngineProcess, forgery: str) -> None:
    """A peer (here in this process) whose offer points at memory it never registered, or at
    another bucket's bytes: NIXL refuses the first, the digests catch the second."""
    from weightsync.wire.checkpoint import read_checkpoint
    host = PeerHost(bucket_bytes=4096)
    host.publish(V, read_checkpoint(models["current"], lambda n, t: None))
    assert host.offer is not None
    forged = copy.deepcopy(host.offer)
    entries = forged["nixl"]["buckets"]
    if forgery == "unregistered":
        entries[1]["descs"] = [[d[0] + (1 << 40), d[1], d[2]] for d in entries[1]["descs"]]
    else:
        entries[0]["descs"], entries[1]["descs"] = entries[1]["descs"], entries[0]["descs"]
        entries[0]["nbytes"], entries[1]["nbytes"] = entries[1]["nbytes"], entries[0]["nbytes"]
    host.offer = forged
    server = serve_host(host, port=free_port())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        token = new_token()
        host.share(token, 60)
        why = "no registered memory at the descriptors sent" if forgery == "unregistered" else \
            "digest|does not match|differ"
        with pytest.raises(EngineError, match=why):
            pull(joiner, {"url": url, "token": token, "source": "nixl"}, weights)
        assert_unchanged(joiner)
    finally:
        server.shutdown()
        server.server_close()
        host.close()


def test_a_joiner_catches_up_over_nixl_bit_exact(tmp_path: Path, models: dict[str, Path],
                                                 weights: dict[str, Any],
                                                 joiner: EngineProcess) -> None:
    """Last: after every failure above, the same joiner catches up from a sound peer."""
    with PeerProcess(models["current"], V, tmp_path / "peer.log", bucket_bytes=64 << 10) as peer:
        assert joiner.health()["version"] == 0
        assert pull(joiner, peer.share(), weights) == V
        h = joiner.health()
        assert h["version"] == V and h["peer"]["pulled"] == 1 and h["peer"]["from"] == peer.url
        assert joiner.holds(weights)
        assert peer.health()["reads"] > 1         # every bucket came by READ, none over HTTP
