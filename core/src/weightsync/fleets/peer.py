"""Peer join: a member that is behind pulls the current version from a member that holds it.

The serving member opens a *share* (a random token with a time to live) and serves its live
weights as a JSON manifest and one payload frame per bucket; the joiner commits only when every
bucket arrived and matched. The peer's manifest proves
only that bytes arrived as sent: a join is anchored by the *trainer's* digests for the version
(`anchor`, from the registry), and a tensor the trainer never sends must equal the joiner's own.
A share serves one pull of the version it was opened at (the manifest once, each bucket once)."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weightsync.wire import bucket as buckets
from weightsync.wire.bucket import digest_tensors
from weightsync.errors import PayloadError
from weightsync.interfaces import NoOptions, PeerSource
from weightsync.wire.frame import frame, pack, unframe

FORMAT = "weightsync-peer/1"
SHARE_HEADER = "X-Weightsync-Share"
MAX_MANIFEST = 64 * 2**20


class PeerTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=16)


class PeerBucket(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = Field(ge=0)
    last: bool
    digest: str = Field(min_length=1, max_length=200)
    nbytes: int = Field(ge=0, le=2**40)
    tensors: list[PeerTensor]


class PeerManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: str
    version: int = Field(ge=0)
    buckets: list[PeerBucket]

    def check(self) -> "PeerManifest":
        if self.format != FORMAT:
            raise PayloadError(f"peer manifest format {self.format!r} is not {FORMAT!r}")
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise PayloadError("peer manifest buckets are not numbered 0..n-1")
        if not self.buckets or not self.buckets[-1].last or any(b.last for b in self.buckets[:-1]):
            raise PayloadError("peer manifest must mark exactly its final bucket as last")
        names = [t.name for b in self.buckets for t in b.tensors]
        if len(set(names)) != len(names):
            raise PayloadError("peer manifest names a tensor twice")
        return self


def parse_manifest(raw: Any) -> PeerManifest:
    try:
        return PeerManifest.model_validate(raw).check()
    except ValidationError as e:
        raise PayloadError(f"peer manifest is malformed: {e.errors()[0]['msg']} at "
                           f"{'.'.join(map(str, e.errors()[0]['loc']))}") from None


# -- serving side ------------------------------------------------------------------------------
@dataclass
class Shares:
    """Tokens a serving member accepts until they expire, and its current version's manifest."""

    bucket_bytes: int = 64 * 2**20
    key: bytes | None = None                      # the fleet's HMAC key: frames are signed
    tokens: dict[str, "_Share"] = field(default_factory=dict)
    served: int = 0                               # buckets served to joiners
    lock: threading.Lock = field(default_factory=threading.Lock)
    _manifest: tuple[int, dict[str, Any], list[list[str]]] | None = None

    def open(self, token: str, ttl: float, version: int = -1) -> None:
        """Accept `token` for one pull of `version` (the version held now) within `ttl` s."""
        if not (16 <= len(token) <= 256):
            raise PayloadError("a share token must be 16 to 256 characters")
        if not 0 < ttl <= 24 * 3600:
            raise PayloadError(f"share ttl {ttl:g}s is outside (0, 86400]")
        with self.lock:
            now = time.monotonic()
            self.tokens = {t: e for t, e in self.tokens.items() if e.expires > now}
            self.tokens[token] = _Share(now + ttl, int(version))

    def check(self, token: str | None, version: int, index: int | None = None) -> None:
        """Let `token` read the manifest (`index` None) or bucket `index` of `version` once."""
        from weightsync.net.server import HttpError
        with self.lock:
            share = self.tokens.get(token or "")
            if share is None or share.expires < time.monotonic():
                self.tokens.pop(token or "", None)
                raise HttpError(401, "missing, unknown, used or expired share token: ask the "
                                     "registry for a peer again")
            if share.version != version:
                del self.tokens[token or ""]
                raise HttpError(409, f"this share was for version {share.version}; the peer holds "
                                     f"version {version} now: ask the registry for a peer again")
            what = "manifest" if index is None else index
            if what in share.used:
                name = "the manifest" if index is None else f"bucket {index}"
                raise HttpError(401, f"this share token already served {name}: a share serves "
                                     f"one pull")
            share.used.add(what)

    def served_all(self, token: str | None, buckets: int) -> None:
        """The token's pull has every bucket: it dies."""
        with self.lock:
            share = self.tokens.get(token or "")
            if share is not None and sum(isinstance(u, int) for u in share.used) >= buckets:
                del self.tokens[token or ""]

    def manifest(self, version: int, store: Any) -> dict[str, Any]:
        """The manifest of `store` at `version` (the caller holds the model lock)."""
        with self.lock:
            if self._manifest is not None and self._manifest[0] == version:
                return self._manifest[1]
        plan = list(buckets.pack(((n, store.get(n)) for n in store.names()), self.bucket_bytes))
        plan = plan or [buckets.Bucket(0, [], last=True)]      # an empty model: one empty bucket
        out = {"format": FORMAT, "version": version, "buckets": [
            {"index": b.index, "last": b.last, "digest": b.digest(), "nbytes": b.nbytes,
             "tensors": [s.to_json() for s in b.specs()]} for b in plan]}
        with self.lock:
            self._manifest = (version, out, [b.names for b in plan])
        return out

    def bucket(self, version: int, index: int, store: Any) -> list[Any]:
        """One payload frame of the current version (the caller holds the model lock)."""
        man = self.manifest(version, store)
        assert self._manifest is not None
        plan = self._manifest[2]
        if not 0 <= index < len(plan):
            raise PayloadError(f"bucket {index} does not exist (the manifest has {len(plan)})")
        named = [(n, store.get(n).detach().to("cpu")) for n in plan[index]]
        body = pack(named)
        b = man["buckets"][index]
        header = {"index": index, "last": b["last"], "encoding": "raw", "digest": b["digest"],
                  "tensors": b["tensors"], "nbytes": body.numel(), "meta": {}, "version": version}
        if self.key is not None:
            from weightsync.wire.signing import sign
            header["sig"] = sign(self.key, version, header)
        with self.lock:
            self.served += 1
        return frame(header, body)


@dataclass
class _Share:
    expires: float
    version: int
    used: set[Any] = field(default_factory=set)      # "manifest" and bucket indexes served


def new_token() -> str:
    return secrets.token_urlsafe(24)


# -- joining side ------------------------------------------------------------------------------
class HttpPeerSource(PeerSource):
    """Fetches a peer's manifest and buckets over HTTP (the peer's own routes)."""

    name = "http"
    Options = NoOptions

    def __init__(self, options: Any = None, timeout: float = 300.0) -> None:
        super().__init__(options)
        self.session, self.timeout = requests.Session(), timeout

    def _get(self, peer: Mapping[str, Any], path: str, params: dict[str, Any], cap: int) -> bytes:
        url = str(peer["url"]).rstrip("/") + path
        try:
            with self.session.get(url, params=params, headers={SHARE_HEADER: str(peer["token"])},
                                  timeout=self.timeout, stream=True) as r:
                if r.status_code != 200:
                    raise PayloadError(f"peer {peer['url']}: GET {path} -> HTTP {r.status_code}: "
                                       f"{r.text[:300]}")
                n = int(r.headers.get("Content-Length") or -1)
                if n > cap:
                    raise PayloadError(f"peer {peer['url']}: GET {path} answers {n} bytes, more "
                                       f"than the {cap} expected")
                buf = bytearray()
                for chunk in r.iter_content(4 * 2**20):
                    buf += chunk
                    if len(buf) > cap:
                        raise PayloadError(f"peer {peer['url']}: GET {path} sent more than {cap} bytes")
                return bytes(buf)
        except requests.RequestException as e:
            raise PayloadError(f"peer {peer['url']} cannot be reached: {type(e).__name__}") from None

    def manifest(self, peer: Mapping[str, Any]) -> dict[str, Any]:
        import json
        raw = self._get(peer, "/weightsync/peer/manifest", {}, MAX_MANIFEST)
        try:
            return json.loads(raw)
        except ValueError:
            raise PayloadError(f"peer {peer['url']}: the manifest is not JSON") from None

    def bucket(self, peer: Mapping[str, Any], index: int) -> tuple[dict[str, Any], memoryview]:
        cap = int(peer.get("max_bucket_bytes") or 2**40)
        raw = self._get(peer, "/weightsync/peer/bucket",
                        {"index": index, "version": peer.get("version")}, cap)
        return unframe(raw)


def pull(source: PeerSource, peer: Mapping[str, Any], session_for: Callable[[int], Any],
         holds: int) -> int:
    """Stage the peer's newer version into `session_for(version)`; returns it, else `holds`."""
    man = parse_manifest(source.manifest(peer))
    if man.version <= holds:
        return holds
    session = session_for(man.version)
    want = {}
    peer = {**peer, "version": man.version,
            "max_bucket_bytes": max(b.nbytes for b in man.buckets) + MAX_MANIFEST}
    for b in man.buckets:
        header, body = source.bucket(peer, b.index)
        if int(header.get("version", -1)) != man.version:
            raise PayloadError(f"peer {peer['url']} moved on from version {man.version} during the "
                               f"pull; nothing was applied; pull again")
        if header.get("index") != b.index or header.get("digest") != b.digest \
                or [t.get("name") for t in header.get("tensors", [])] != [t.name for t in b.tensors]:
            raise PayloadError(f"peer {peer['url']}: bucket {b.index} does not match its manifest")
        want[b.index] = b.digest
        session.apply(header, body)
    got = session.end()
    if got != want:
        raise PayloadError(f"peer {peer['url']}: staged digests differ from the manifest's; "
                           f"nothing was applied")
    check_anchor(peer, man.version, session)
    return man.version


def check_anchor(peer: Mapping[str, Any], version: int, session: Any) -> None:
    """What was staged against the trainer's digests for `version` (tensors the trainer never
    sends against the joiner's own); PayloadError naming the peer."""
    from weightsync.wire.bucket import digest_algo
    anchor = peer.get("anchor")
    if not isinstance(anchor, Mapping) or not isinstance(anchor.get("buckets"), list):
        raise PayloadError("a peer join needs the trainer's digests for the version (anchor) "
                           "from the registry; nothing was applied")
    if anchor.get("version") != version:
        raise PayloadError(f"peer {peer['url']} serves version {version}, but the trainer's "
                           f"digests are for version {anchor.get('version')}; nothing was applied")
    staged = session.staged
    covered: set[str] = set()
    bad: list[str] = []
    for entry in anchor["buckets"]:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2
                and isinstance(entry[0], list) and isinstance(entry[1], str)):
            raise PayloadError("the trainer's digests (anchor) are malformed; nothing was applied")
        names, digest = [str(n) for n in entry[0]], entry[1]
        missing = [n for n in names if n not in staged]
        if missing:
            raise PayloadError(f"peer {peer['url']} did not serve tensor {missing[0]!r} of "
                               f"version {version}; nothing was applied")
        covered.update(names)
        if digest_tensors([(n, staged[n]) for n in names], digest_algo(digest)) != digest:
            bad.append(names[0])
    for n, t in staged.items():
        if n not in covered:
            live = session.store.get(n)
            if live is None or digest_tensors([(n, live.detach().cpu())], "xxh3") \
                    != digest_tensors([(n, t.detach().cpu())], "xxh3"):
                bad.append(n)
    if bad:
        raise PayloadError(f"peer {peer['url']} served other weights than the trainer pushed as "
                           f"version {version} (tensors {bad[:5]!r} differ from the trainer's "
                           f"digests)")


__all__ = ["FORMAT", "HttpPeerSource", "MAX_MANIFEST", "PeerManifest", "SHARE_HEADER", "Shares",
           "check_anchor", "new_token", "parse_manifest", "pull"]
