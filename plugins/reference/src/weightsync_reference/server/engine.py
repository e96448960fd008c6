"""The reference engine's state machine: generation, pause gates, and one update round at a time.
Weights change only at commit, between two decoding steps, under the model lock.

Rounds and leases: `begin` opens the one live round, with an id and a lease; every later call
of the round carries the id, and the trainer renews the lease while it works. A call with
another id, or a second `begin` while a round is open, is refused (Conflict, HTTP 409). When a
lease lapses (the trainer died or hung) a watchdog aborts the round, drops what it staged and, if
the engine was paused under a lease, resumes it: the engine serves again at its old version."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from weightsync.wire.bucket import dtype_name
from weightsync.errors import PayloadError
from weightsync.fleets.peer import pull
from weightsync.interfaces import Announce
from weightsync.receive import ReceiveSession, check_tensor
from weightsync.wire.checkpoint import read_checkpoint
from weightsync.transports.http.member_relay import Desk, relay
from weightsync.transports.http import ExpectRelay, RelayOutcome
from weightsync.wire.signing import check_checkpoint
from weightsync_reference.server.generation import Conflict, Generation
from weightsync_reference.server.model import LoadedModel
from weightsync_reference.server.sampler import PAUSE_MODES, BatchingSampler
from weightsync_reference.server.sharing import Sharing

log = logging.getLogger("weightsync_reference.server")
DEFAULT_LEASE = 10.0
MAX_LEASE = 3600.0


def _lease(value: Any) -> float:
    try:
        lease = float(DEFAULT_LEASE if value is None else value)
    except (TypeError, ValueError):
        raise PayloadError(f"lease {value!r} is not a number of seconds") from None
    if not 0 < lease <= MAX_LEASE:
        raise PayloadError(f"lease {lease:g}s is outside (0, {MAX_LEASE:g}] seconds")
    return lease


@dataclass
class OpenRound:
    id: str
    version: int
    session: ReceiveSession
    lease: float
    expires: float                      # time.monotonic() deadline
    desk: Desk = field(default_factory=Desk)    # relay shapes: what the trainer announced

    def left(self) -> float:
        return max(0.0, self.expires - time.monotonic())


class ReferenceEngine(Generation):
    def __init__(self, model: LoadedModel, components: Any, name: str = "reference",
                 watchdog: bool = True, hmac_key: bytes | None = None,
                 share_source: str = "http") -> None:
        self.model = model
        self.hmac_key = hmac_key                 # payloads (and peer frames) must be signed
        self.components = components
        self.name = name
        self.version = 0
        self.model_lock = threading.Lock()       # held per decoding step and by commit
        self.state = threading.Condition()
        self.paused: str | None = None           # None, "abort", "keep" or "keep_stale_kv"
        self.last_pause: str | None = None       # the mode of the latest pause (the swap's)
        self.pause_epoch = 0
        self.pause_expires: float | None = None  # a pause taken under a lease ends by itself
        self.pause_at: tuple[str, int] | None = None  # a pause armed to begin at a token count
        self.round: OpenRound | None = None
        self.session_lock = threading.RLock()
        self.lapsed = 0                          # rounds and pauses ended by a lapsed lease
        self.sharing = Sharing(components, share_source, hmac_key)   # what joiners pull
        self.pulled = 0                          # versions taken from a peer
        self.pulled_from: str | None = None
        self.membership: Any = None        # weightsync.fleets.member.Membership, with --fleet
        # buckets that came through a relay; "streamed": of those, staged as they arrived
        self.relayed = {"received": 0, "forwarded": 0, "streamed": 0}
        self.distrusted: dict[str, Any] | None = None   # set when the trainer's probe failed
        self.sampler: BatchingSampler | None = None
        if model.module is not None:
            self.sampler = BatchingSampler(model.module, self._step_gate([0]), self._locked,
                                           lambda: self.last_pause == "keep_stale_kv")
        self._stop = threading.Event()
        if watchdog:
            threading.Thread(target=self._watch, name="ws-lease-watchdog", daemon=True).start()

    def pause(self, mode: str, lease: float | None = None, after_tokens: int | None = None) -> None:
        """Pause generation; with `lease` the pause ends by itself unless renewed. "keep" holds
        running generations and, when the weights change before they go on, prefills them again
        with the new weights; "keep_stale_kv" goes on over the old weights' KV cache instead
        (tokens of neither version: only when asked for); "abort" ends them. `after_tokens` arms
        a hold that begins between two decoding steps once that many more tokens were generated
        (a swap lands inside a generation at a known token, whatever the machine's speed)."""
        if mode not in PAUSE_MODES:
            raise PayloadError(f"pause mode {mode!r} is not supported; use one of "
                               f"{', '.join(PAUSE_MODES)}")
        if after_tokens is not None:
            if mode == "abort" or self.sampler is None or after_tokens < 0:
                raise PayloadError("after_tokens (a count >= 0) arms a hold, mode keep or "
                                   "keep_stale_kv, on an engine that generates")
            with self.state:
                self.pause_at = (mode, self.sampler.tokens + after_tokens)
            return
        with self.state:
            self.paused = self.last_pause = mode
            self.pause_epoch += 1
            self.pause_expires = None if lease is None else time.monotonic() + _lease(lease)
            self.state.notify_all()

    def resume(self) -> None:
        with self.state:
            self.paused = self.pause_at = None
            self.pause_expires = None
            self.state.notify_all()

    # -- update round -----------------------------------------------------------------------
    def begin(self, version: int, plan: Mapping[str, Any], lease: float | None = None) -> OpenRound:
        lease = _lease(lease)
        with self.session_lock:
            self._expire()
            if self.round is not None:
                r = self.round
                raise Conflict(f"round {r.id} (version {r.version}) is open; this begin of version "
                               f"{version} is refused; the open round's lease expires in "
                               f"{r.left():.1f}s unless its trainer renews it")
            if version <= self.version:
                raise Conflict(f"version {version} is not newer than the engine's version {self.version}")
            session = ReceiveSession(self.model.store, {**plan, "version": version,
                                                        "engine_version": self.version},
                                     self.components, self.hmac_key)
            self.round = OpenRound(secrets.token_hex(8), version, session, lease,
                               time.monotonic() + lease)
            log.info("round %s opened for version %d (lease %.1fs)", self.round.id, version, lease)
            return self.round

    def _current(self, rid: str | None) -> OpenRound:
        r = self.round
        if r is None:
            raise Conflict(f"round {rid} is not open: no round is (it was committed or aborted, or "
                           f"its lease lapsed); begin a new round")
        if rid != r.id:
            raise Conflict(f"round {rid} is not the open round: round {r.id} (version {r.version}) "
                           f"is, and its lease expires in {r.left():.1f}s")
        return r

    def renew(self, rid: str | None, lease: float | None = None) -> dict[str, Any]:
        """Extend the open round's lease (when `rid` is given) and a leased pause."""
        out: dict[str, Any] = {}
        with self.session_lock:
            self._expire()
            if rid is not None:
                r = self._current(rid)
                r.lease = _lease(lease if lease is not None else r.lease)
                r.expires = time.monotonic() + r.lease
                out["round"] = {"id": r.id, "expires_in": r.lease}
        with self.state:
            if self.pause_expires is not None:
                seconds = _lease(lease)
                self.pause_expires = time.monotonic() + seconds
                out["pause"] = {"mode": self.paused, "expires_in": seconds}
        return out

    def deliver(self, rid: str | None, kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """One transport message of the open round. The http relay's two are this engine's own
        (its relay desk); an announce first makes a relay of the same bucket give way; every
        other kind goes to the round's transport receiving half (`ReceiveSession.deliver`)."""
        if kind == ExpectRelay.kind:
            self.expect(rid, body)
            return {"status": "expected"}
        if kind == RelayOutcome.kind:
            return self.relay_answer(rid, body.get("index"), float(body.get("wait", 30.0)))
        r = self._current(rid)
        if kind == Announce.kind:
            r.desk.supersede(body.get("index"))
        return r.session.deliver(kind, body)

    def apply(self, rid: str | None, header: Mapping[str, Any], body: memoryview | None) -> str:
        r = self._current(rid)
        r.desk.supersede(header.get("index"))
        return r.session.apply(header, body)

    def apply_stream(self, rid: str | None, header: Mapping[str, Any],
                     read_into: Callable[[memoryview], int], nbytes: int) -> str:
        """`apply` for a body still arriving on the request (the http payload route); a relay
        of the same bucket gives way (transports.http.member_relay.Desk.supersede)."""
        r = self._current(rid)
        r.desk.supersede(header.get("index"))
        return r.session.apply_stream(header, read_into, nbytes)

    def expect(self, rid: str | None, body: Mapping[str, Any]) -> None:
        """The trainer announces a bucket that will arrive through a relay
        (transports.http.member_relay)."""
        self._current(rid).desk.expect(body)

    def relay(self, rid: str | None, token: str | None, read_into: Callable[[memoryview], int],
              total: int, cancel: Callable[[], None] | None = None) -> dict[str, Any]:
        """A frame forwarded by a parent member: token checked before any body byte is read;
        `cancel` shuts its connection (transports.http.member_relay.Desk.supersede)."""
        from weightsync.wire.frame import read_frame_header
        r = self._current(rid)
        r.desk.check_token(token)
        header, nbytes = read_frame_header(read_into, total)
        out = relay(r.session, r.desk, header, read_into, nbytes, cancel)
        self.relayed["received"] += 1
        self.relayed["streamed"] += bool(out.get("streamed"))
        self.relayed["forwarded"] += len(r.desk.get(header.get("index")).children)
        return out

    def relay_answer(self, rid: str | None, index: Any, wait: float) -> dict[str, Any]:
        """The trainer's long poll for a relayed bucket's outcome
        (transports.http.member_relay.Desk.answer);
        the round's lock is not held while it waits."""
        return self._current(rid).desk.answer(index, min(max(0.0, wait), 600.0))

    def end(self, rid: str | None) -> dict[int, str]:
        return self._current(rid).session.end()

    def commit(self, rid: str | None, version: int) -> None:
        with self.session_lock:
            r = self._current(rid)
            if r.version != version:
                raise Conflict(f"commit of version {version}, but round {r.id} is for {r.version}")
            r.desk.close()                   # no relay writes into staging past here
            with self.model_lock:
                r.session.commit()
                self.version = version
                self.sharing.moved()
                self.distrusted = None
            self.round = None
        with self.state:
            self.state.notify_all()          # requests waiting for this version
        log.info("round %s committed: version %d", r.id, version)

    def abort(self, rid: str | None) -> None:
        """Drop the open round. Aborting a round that is no longer open is a no-op (the trainer
        cleans up after failures); aborting another trainer's round is refused."""
        with self.session_lock:
            if self.round is None:
                return
            r = self._current(rid)
            self.round = None
            r.desk.close()
            r.session.close()
        log.info("round %s aborted; version stays %d", r.id, self.version)

    # -- peer join -------------------------------------------------------------------------
    def share(self, token: str, ttl: float) -> dict[str, Any]:
        """Let a joiner holding `token` pull this engine's current version once, within `ttl`
        seconds (the token dies with that pull, or when this engine moves on)."""
        with self.model_lock:
            return self.sharing.share(token, ttl, self.version, self.model.store)

    def peer_manifest(self, token: str | None) -> dict[str, Any]:
        with self.model_lock:
            return self.sharing.manifest(token, self.version, self.model.store)

    def peer_bucket(self, token: str | None, index: int, version: int) -> list[Any]:
        with self.model_lock:
            if version != self.version:
                raise Conflict(f"this peer holds version {self.version} now, not {version}; "
                               f"pull again")
            return self.sharing.bucket(token, index, self.version, self.model.store)

    def pull(self, peer: Mapping[str, Any], lease: float = 600.0) -> int:
        """Catch up from a peer (see weightsync.fleets.peer): everything is staged and checked in
        a round of its own (trainer rounds are refused meanwhile), then committed at once."""
        source = self.components.peer_sources.get(str(peer.get("source") or "http"))()
        rid: list[str] = []

        def session_for(version: int) -> ReceiveSession:
            r = self.begin(version, {"transport": {"kind": "http"}, "encoding": {"kind": "raw"}},
                           lease)
            rid.append(r.id)
            return r.session
        try:
            got = pull(source, peer, session_for, self.version)
        except BaseException as e:
            if rid:
                self.abort(rid[0])
            raise PayloadError(f"pull from peer {peer.get('url')} failed: {e}; nothing was "
                               f"applied, this engine stays at version {self.version}") from None
        if rid:
            self.commit(rid[0], got)
            self.pulled += 1
            self.pulled_from = str(peer.get("url"))
            log.info("caught up from peer %s: version %d", self.pulled_from, got)
        return self.version

    # -- leases -----------------------------------------------------------------------------
    def _expire(self) -> None:
        """Abort a round whose lease lapsed (called under session_lock, and by the watchdog)."""
        r = self.round
        if r is not None and time.monotonic() > r.expires:
            self.round = None
            self.lapsed += 1
            log.warning("round %s (version %d): lease lapsed after %.1fs without renewal; aborted, "
                        "the engine stays at version %d", r.id, r.version, r.lease, self.version)
            threading.Thread(target=_close, args=(r,), daemon=True, name="ws-round-close").start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            with self.session_lock:
                self._expire()
            with self.state:
                if self.pause_expires is not None and time.monotonic() > self.pause_expires:
                    self.lapsed += 1
                    log.warning("pause lease lapsed without renewal: resuming generation")
                    self.paused = None
                    self.pause_expires = None
                    self.state.notify_all()

    def close(self) -> None:
        self._stop.set()
        self.sharing.close()

    def load_from_disk(self, path: str, version: int, allow_older: bool = False,
                       signature: Any = None) -> int:
        """Reload weights from every *.safetensors in `path` (a host-local checkpoint the disk
        agent keeps) and set `version`. Everything is read and checked first, then applied under
        the model lock in one step, so any error leaves the engine untouched at its version.
        The version rules of pushes hold: only a newer version, unless the operator says
        `allow_older`; with an HMAC key, only a checkpoint signed as that version."""
        if int(version) < 0:
            raise PayloadError(f"version {version} is negative")
        self._check_newer(int(version), allow_older)
        named = read_checkpoint(path, lambda n, t: check_tensor(self.model.store, n, t))
        check_checkpoint(self.hmac_key, path, int(version), named, signature)
        with self.session_lock:
            self._expire()
            if self.round is not None:
                raise Conflict(f"round {self.round.id} is open; finish or abort it before reloading "
                               f"from disk")
            self._check_newer(int(version), allow_older)
            with self.model_lock:
                self.model.store.load(named)
                self.version = int(version)
                self.sharing.moved()
        with self.state:
            self.state.notify_all()
        return self.version

    def _check_newer(self, version: int, allow_older: bool) -> None:
        if version <= self.version and not allow_older:
            raise Conflict(f"this engine holds version {self.version}; loading version {version} "
                           f"from disk would move it back (or give one version label two weight "
                           f"sets); load a newer version, or pass allow_older: true to roll back "
                           f"on purpose")

    # -- introspection ----------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        r = self.round
        return {"status": "ok", "version": self.version, "weight_version": self.version,
                "paused": self.paused, "distrusted": self.distrusted,
                "relay": dict(self.relayed), "peer": {"pulled": self.pulled, "from": self.pulled_from,
                                                **self.sharing.health()},
                "round": None if r is None else {"id": r.id, "version": r.version,
                                                 "expires_in": round(r.left(), 3)},
                "fleet": self.fleet_error()}

    def fleet_error(self) -> dict[str, Any] | None:
        """Why this engine's fleet membership is not in effect now (None: it is, or it has none)."""
        m = self.membership
        return None if m is None or m.error is None else {"error": m.error}

    def info(self) -> dict[str, Any]:
        store = self.model.store
        return {"name": self.name, "version": self.version, "model": self.model.kind,
                "paused": self.paused, "can_generate": self.model.module is not None,
                "generated_tokens": self.sampler.tokens if self.sampler else 0,
                "reprefills": self.sampler.reprefills if self.sampler else 0,
                "batches": self.sampler.batches if self.sampler else 0,
                "busy_seconds": round(self.sampler.busy_seconds(), 6) if self.sampler else 0.0,
                "tensors": {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                            for n in store.names() if (t := store.get(n)) is not None}}

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        with self.model_lock:
            for n in names or self.model.store.names():
                t = self.model.store.get(n)
                if t is None:
                    raise PayloadError(f"tensor {n!r} is not in the engine's model")
                out[n] = t.detach().to("cpu", copy=True).contiguous()
        return out


def _close(r: OpenRound) -> None:
    """End a round whose lease lapsed: its relays first, then its session."""
    r.desk.close()
    r.session.close()
