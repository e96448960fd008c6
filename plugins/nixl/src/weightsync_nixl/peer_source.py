"""Peer source `nixl` (the joiner's side): the manifest, the peer's agent metadata and each
bucket's descriptors come over HTTP once per share token (`weightsync_nixl.peer_host`); every
bucket is then READ one-sided from the peer's registered memory into this process's registered
memory. Whatever arrives is checked by weightsync's `pull` (manifest digests, then the trainer's
digests) before anything is committed; here every field of the offer is checked before a byte
moves, and a token serves one pull."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import requests
import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import PayloadError
from weightsync.fleets.peer import MAX_MANIFEST, parse_manifest
from weightsync.interfaces import PeerSource
from weightsync_nixl.agent import NAME_RE, Desc, agent
from weightsync_nixl.messages import MEM_TYPES, parse_descs, parse_metadata
from weightsync_nixl.peer_host import SHARE_HEADER, PeerHost
from weightsync_nixl.staging import staging

ROLE = "joiner"
TIMEOUT_ENV = "WEIGHTSYNC_NIXL_PEER_TIMEOUT"
BUCKET_ENV = "WEIGHTSYNC_NIXL_PEER_BUCKET_BYTES"


class PeerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(default_factory=lambda: float(os.environ.get(TIMEOUT_ENV) or 120.0),
                           gt=0, description=f"seconds for the manifest and for each bucket's "
                                             f"READ (default ${TIMEOUT_ENV}, else 120)")
    bucket_bytes: int = Field(
        default_factory=lambda: int(os.environ.get(BUCKET_ENV) or 64 * 2**20), gt=0,
        description=f"the serving half's bucket size, when a member hosts its version (default "
                    f"${BUCKET_ENV}, else 64 MiB)")


@dataclass
class _Pull:
    agent: str
    mem: str
    buckets: list[tuple[int, list[Desc]]]        # per bucket: nbytes, descriptors
    headers: list[dict[str, Any]]
    left: set[int]


class NixlPeerSource(PeerSource):
    name = "nixl"
    Options = PeerOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.session = requests.Session()
        self.pulls: dict[str, _Pull] = {}
        self.lock = threading.Lock()

    def hosting(self) -> PeerHost:
        """The serving half: a member keeps its version in registered memory for joiners."""
        return PeerHost(bucket_bytes=self.options.bucket_bytes)

    def manifest(self, peer: Mapping[str, Any]) -> dict[str, Any]:
        url = str(peer["url"]).rstrip("/")
        try:
            r = self.session.get(url + "/weightsync/peer/manifest", timeout=self.options.timeout,
                                 headers={SHARE_HEADER: str(peer.get("token"))})
        except requests.RequestException as e:
            raise PayloadError(f"peer {url} cannot be reached: {type(e).__name__}") from None
        if r.status_code != 200:
            raise PayloadError(f"peer {url}: GET /weightsync/peer/manifest -> HTTP "
                               f"{r.status_code}: {r.text[:300]}")
        if len(r.content) > MAX_MANIFEST:
            raise PayloadError(f"peer {url}: the manifest is larger than {MAX_MANIFEST} bytes")
        try:
            offer = json.loads(r.content)
        except ValueError:
            raise PayloadError(f"peer {url}: the manifest is not JSON") from None
        if not isinstance(offer, dict):
            raise PayloadError(f"peer {url}: the manifest is not a JSON object")
        man = parse_manifest(offer.get("manifest"))
        pull = self._offer(url, man, offer.get("nixl"))
        with self.lock:
            self.pulls[str(peer.get("token"))] = pull
        return dict(offer["manifest"])

    def _offer(self, url: str, man: Any, raw: Any) -> _Pull:
        """The NIXL part of an offer, checked against the manifest it came with."""
        if not isinstance(raw, dict):
            raise PayloadError(f"peer {url} offers no NIXL descriptors (is it a NIXL peer?)")
        name, mem, entries = raw.get("agent"), raw.get("mem"), raw.get("buckets")
        if not isinstance(name, str) or not NAME_RE.match(name) or mem not in MEM_TYPES:
            raise PayloadError(f"peer {url}: agent {name!r} or memory type {mem!r} is malformed")
        if not isinstance(entries, list) or len(entries) != len(man.buckets):
            raise PayloadError(f"peer {url}: descriptors for {len(entries or [])} buckets, the "
                               f"manifest has {len(man.buckets)}")
        buckets = []
        for b, e in zip(man.buckets, entries):
            if not isinstance(e, dict) or e.get("index") != b.index:
                raise PayloadError(f"peer {url}: bucket {b.index}'s descriptors are malformed")
            n = e.get("nbytes")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= b.nbytes + MAX_MANIFEST:
                raise PayloadError(f"peer {url}: bucket {b.index} claims {n!r} bytes, more than "
                                   f"its tensors and a header")
            buckets.append((n, parse_descs(e.get("descs"), n, f"peer {url}, bucket {b.index}")
                            if n else []))
        agent(ROLE).remote(name, parse_metadata(raw.get("metadata")))
        headers = [{"index": b.index, "last": b.last, "encoding": "raw", "digest": b.digest,
                    "tensors": [t.model_dump() for t in b.tensors], "meta": {},
                    "version": man.version} for b in man.buckets]
        return _Pull(name, str(mem), buckets, headers, set(range(len(buckets))))

    def bucket(self, peer: Mapping[str, Any], index: int) -> tuple[dict[str, Any], memoryview]:
        token, url = str(peer.get("token")), str(peer.get("url"))
        with self.lock:
            pull = self.pulls.get(token)
        if pull is None:
            raise PayloadError(f"peer {url}: no manifest was fetched with this share token here, "
                               f"or the token already served its pull: ask the registry for a "
                               f"peer again")
        if not 0 <= index < len(pull.buckets):
            raise PayloadError(f"peer {url}: bucket {index} does not exist (the manifest has "
                               f"{len(pull.buckets)})")
        nbytes, descs = pull.buckets[index]
        me = agent(ROLE)
        body = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with staging(me, "cpu").slot(nbytes) as buf:
                me.read(buf, pull.agent, descs, pull.mem, f"read:{token[:32]}:{index}".encode(),
                        time.monotonic() + self.options.timeout, f"peer {url}, bucket {index}")
                body.copy_(buf)
        with self.lock:
            pull.left.discard(index)
            if not pull.left:                      # a token serves one pull
                self.pulls.pop(token, None)
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        return {**pull.headers[index], "nbytes": nbytes}, memoryview(body.numpy())  # type: ignore[arg-type]
