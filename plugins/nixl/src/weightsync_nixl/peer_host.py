"""The serving side of peer join over NIXL (checkpoint-engine's pattern): a member keeps its
current version packed, one payload per bucket, in memory registered with NIXL, and a joiner
READs the buckets one-sided. Over HTTP the host hands out only what a joiner needs to read: the
manifest of the version (`weightsync.fleets.peer`: tensors and digests per bucket), its agent's
metadata and each bucket's descriptors, once per share token. The descriptors are the capability
(as an RDMA key is): a share token gates them; what a joiner reads it checks against the
trainer's digests before anything is committed.

Routes: POST /weightsync/peer/share {"token", "ttl"} (API key) -> {"version", "source": "nixl"};
GET /weightsync/peer/manifest (X-Weightsync-Share) -> {"manifest", "nixl"}; GET /health."""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch

from weightsync.fleets.peer import Shares
from weightsync.interfaces import PeerHosting
from weightsync.net.server import HttpError, Routes, Server, make_server
from weightsync.wire.frame import pack
from weightsync_nixl.agent import Agent, Region, agent
from weightsync_nixl.messages import b64

SHARE_HEADER = "X-Weightsync-Share"
READ_WINDOW = 300.0      # seconds this side progresses for one joiner's READs at most
routes = Routes()


class _Store:
    """A version's named tensors as the `Shares` manifest builder reads them."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self.named = dict(named)

    def names(self) -> list[str]:
        return list(self.named)

    def get(self, name: str) -> torch.Tensor | None:
        return self.named.get(name)


class PeerHost(PeerHosting):
    """Holds one version in registered memory; `publish` a newer one, `withdraw` to stop serving.
    A member's serving half (`NixlPeerSource.hosting`), or a process of its own (`serve`)."""

    def __init__(self, bucket_bytes: int = 64 * 2**20, nixl: Agent | None = None) -> None:
        self.agent = nixl or agent("peer")
        self.shares = Shares(bucket_bytes=bucket_bytes)
        self.lock = threading.Lock()
        self.version: int | None = None
        self.region: Region | None = None
        self.offer: dict[str, Any] | None = None     # what a share's manifest call returns
        self.reads = 0                               # buckets joiners reported read
        self.retired: list[Region] = []              # deregistered, kept alive: a late READ
        self.pending: dict[str, int] = {}            # share token -> buckets not yet read
        self._stop = threading.Event()
        self.agent.adopt(threading.Thread(target=self._count, daemon=True,
                                          name="ws-nixl-peer-notes")).start()

    def publish(self, version: int, named: Mapping[str, torch.Tensor]) -> None:
        """Serve `version`: pack every bucket into one registered buffer (the old one goes)."""
        store = _Store({n: t.detach().to("cpu").contiguous() for n, t in named.items()})
        manifest = self.shares.manifest(version, store)
        bodies = [pack([(t["name"], store.named[t["name"]]) for t in b["tensors"]])
                  for b in manifest["buckets"]]
        offsets = [sum(x.numel() for x in bodies[:i]) for i in range(len(bodies))]
        flat = torch.empty(max(1, sum(x.numel() for x in bodies)), dtype=torch.uint8)
        for off, body in zip(offsets, bodies):
            flat[off: off + body.numel()].copy_(body)
        region = self.agent.register(flat)
        entries = [{"index": b["index"], "nbytes": body.numel(),
                    "descs": [list(d) for d in region.descs(off, body.numel())] if body.numel() else []}
                   for b, off, body in zip(manifest["buckets"], offsets, bodies)]
        with self.lock:
            old, self.region, self.version = self.region, region, version
            self.offer = {"manifest": manifest, "nixl": {
                "agent": self.agent.name, "metadata": b64(self.agent.metadata()), "mem": region.mem,
                "buckets": entries}}
        self._retire(old)

    def _retire(self, region: Region | None) -> None:
        """Deregister `region`, then zero it: its memory stays allocated a while (never freed
        under a READ). Over RDMA the NIC refuses a READ of deregistered memory; UCX over TCP
        serves it, and zeros then fail the joiner's digest check instead of passing as weights."""
        if region is not None:
            self.agent.deregister(region)
            region.tensor.zero_()
            self.retired = [*self.retired, region][-2:]

    def withdraw(self) -> None:
        """Deregister the version's memory: a joiner's READ of it fails from now on."""
        with self.lock:
            old, self.region, self.offer, self.version = self.region, None, None, None
        self._retire(old)

    def share(self, token: str, ttl: float) -> dict[str, Any]:
        with self.lock:
            if self.version is None:
                raise HttpError(409, "this peer serves no version now")
            self.shares.open(token, ttl, self.version)
            return {"version": self.version, "source": "nixl"}

    def manifest(self, token: str | None) -> dict[str, Any]:
        with self.lock:
            if self.version is None or self.offer is None:
                raise HttpError(409, "this peer serves no version now: ask the registry for a "
                                     "peer again")
            self.shares.check(token, self.version)
            # the joiner READs now: this side progresses until it reported every bucket read
            key = str(token)[:32]                    # as the joiner's notifications name it
            self.pending[key] = len(self.offer["nixl"]["buckets"])
            self.agent.hold(("share", key), READ_WINDOW)
            return self.offer

    def _count(self) -> None:
        """Count the buckets joiners report read (`read:<token>:<index>` notifications); a
        joiner that read every bucket no longer needs this side to progress."""
        while not self._stop.wait(0.05) and not self.agent.closing.is_set():
            self.agent.pump()
            for m in self.agent.take_notes(b"read:"):
                self.reads += 1
                token = m.decode(errors="replace").split(":")[1]
                with self.lock:
                    left = self.pending.get(token)
                    if left is not None:
                        self.pending[token] = left - 1
                        if left <= 1:
                            del self.pending[token]
                            self.agent.release(("share", token))

    def health(self) -> dict[str, Any]:
        offer = self.offer
        return {"status": "ok", "version": self.version, "reads": self.reads,
                "buckets": len(offer["nixl"]["buckets"]) if offer else 0, "agent": self.agent.name}

    def close(self) -> None:
        self._stop.set()
        self.withdraw()
        with self.lock:
            shares, self.pending = list(self.pending), {}
        for token in shares:          # a closed host progresses for no joiner
            self.agent.release(("share", token))


@routes.add("GET", "/health", auth=False, max_body=0)
def _health(h: Any, q: dict) -> Any:
    return h.host.health()


@routes.add("POST", "/weightsync/peer/share")
def _share(h: Any, q: dict) -> Any:
    body = h.json_body() or {}
    if not isinstance(body, dict) or not isinstance(body.get("token"), str):
        raise HttpError(400, "share needs {\"token\": str, \"ttl\": seconds}")
    try:
        ttl = float(body.get("ttl", 600))
    except (TypeError, ValueError):
        raise HttpError(400, "ttl must be a number of seconds") from None
    return h.host.share(body["token"], ttl)


@routes.add("GET", "/weightsync/peer/manifest", auth=False, max_body=0)
def _manifest(h: Any, q: dict) -> Any:
    return h.host.manifest(h.headers.get(SHARE_HEADER))


def serve_host(host: PeerHost, address: str = "127.0.0.1", port: int = 0,
               api_key: str | None = None) -> Server:
    """An HTTP server for `host` (serve it with `serve_forever` on a thread)."""
    return make_server(routes, address, port, api_key=api_key, name="nixl peer",
                       state={"host": host})

