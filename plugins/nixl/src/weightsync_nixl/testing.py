"""Test helpers: a peer host (`python -m weightsync_nixl.serve`) in a child process, the UCX
environment that keeps NIXL on loopback TCP where no RDMA device exists, and the trainer's digests
a peer join is anchored by."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Mapping

import requests

from weightsync.fleets.peer import new_token
from weightsync.net.process import ServerProcess
from weightsync.net.server import free_port
from weightsync.wire.bucket import digest_tensors

LOOPBACK_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa"}


def anchor(weights: Mapping[str, Any], version: int) -> dict[str, Any]:
    """The trainer's digests of `version` (four tensors a bucket), as a registry hands a joiner."""
    names = list(weights)
    groups = [names[i: i + 4] for i in range(0, len(names), 4)]
    return {"version": version, "buckets": [[g, digest_tensors([(n, weights[n]) for n in g])]
                                            for g in groups]}


class PeerProcess:
    def __init__(self, model: Path, version: int, log: Path, bucket_bytes: int = 64 << 20,
                 program: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ServerProcess("nixl peer", log)
        self.argv = [*(program or [sys.executable, "-m", "weightsync_nixl.serve"]),
                     "--model", str(model), "--version", str(version), "--port", str(self.port),
                     "--bucket-bytes", str(bucket_bytes)]

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def start(self) -> "PeerProcess":
        self.server.launch(self.argv)
        self.server.wait_healthy(self.url + "/health", 60.0)
        return self

    def share(self, ttl: float = 120.0) -> dict[str, Any]:
        """What a registry hands a joiner: url, token, source."""
        token = new_token()
        r = requests.post(self.url + "/weightsync/peer/share", json={"token": token, "ttl": ttl},
                          timeout=10)
        r.raise_for_status()
        return {"url": self.url, "token": token, "source": r.json()["source"]}

    def health(self) -> dict[str, Any]:
        return requests.get(self.url + "/health", timeout=5).json()

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        self.server.stop(grace=10.0)

    def __enter__(self) -> "PeerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
