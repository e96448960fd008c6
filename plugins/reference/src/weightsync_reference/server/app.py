"""HTTP routes of the reference engine (weightsync.net.server: one thread per connection, keys
checked before bodies, bodies capped per route, connections capped and timed out).

  GET  /health                      {"status", "version", "weight_version", "paused", "round", "peer"}
                                    (no key needed)
  GET  /info                        version, model kind, tensors (name -> dtype, shape)
  GET  /weights?name=..             live tensors as safetensors bytes (read-back for checks)
  POST /generate                    {"input_ids": [...], "sampling": {n, temperature, top_p, top_k,
                                    seed, max_new_tokens, stop_token_ids}, "min_version"?: v,
                                    "exact_version"?: v, "wait"?: s} -> {"samples": [{output_ids,
                                    logprobs, finish_reason, weight_version, weight_version_end,
                                    weight_versions (each token's), stale_kv}]}
                                    and the first sample's fields at the top; without "sampling":
                                    greedy, {"max_new_tokens": n}; 409 with "weight_version" when
                                    no fitting version arrived within `wait` seconds. Concurrent
                                    requests are batched (one forward pass per token, KV cache)
  POST /score                       {"input_ids": [...]} -> {"logprobs", "weight_version"}: the
                                    logprob of each token after the first (the trainer's probe)
  POST /weightsync/distrust         {"version": v, "reason": r}: the probe failed on version v;
                                    gated generation is refused until a later commit
  POST /pause                       {"mode": "abort"|"keep", "lease": s?, "after_tokens": n?}:
                                    with a lease the pause ends by itself unless renewed; with
                                    after_tokens a hold begins once n more tokens were generated
  POST /resume
  POST /weightsync/begin            {"version": v, "transport": {...}, "encoding": {...}, "lease": s}
                                    -> {"round": id, "version": v, "lease": s}; 409 while a round is open
  POST /weightsync/renew            {"lease": s}: extends the open round's lease (and a leased pause)
  POST /weightsync/payload          frame: u64 header length, JSON header, body (http transport)
  POST /weightsync/relay            (X-Weightsync-Relay: token, no API key) a frame forwarded
                                    by a parent member (weightsync.transports.http.member_relay)
  POST /weightsync/deliver          {"kind", "body"}: one transport message (`Adapter.deliver`):
                                    "announce" (a body placed out of band: shm, collective),
                                    "collective.join", "http.expect" / "http.relayed" (relay
                                    shapes: a bucket to expect; this member's signed outcome, a
                                    long poll), and any other kind to the round's transport
                                    receiving half (a transport plugin's own messages)
  POST /weightsync/end              -> {"digests": {index: digest}}
  POST /weightsync/commit           {"version": v}
  POST /weightsync/abort
  POST /weightsync/load_from_disk   {"path": DIR, "version": v, "allow_older": false, "signature":
                                    {...}?}: reload every
                                    *.safetensors in DIR (a newer version only, unless allow_older;
                                    signed as v when the engine holds an HMAC key)
                                    (only below the directories given with --load-root)
  POST /weightsync/peer/share       {"token": t, "ttl": s}: let a joiner with this token pull
  GET  /weightsync/peer/manifest    (X-Weightsync-Share: t) the current version's manifest
  GET  /weightsync/peer/bucket      ?index=i&version=v (X-Weightsync-Share: t) one payload frame
  POST /weightsync/pull             {"peer": {"url", "token", "source"}}: catch up from that peer

Every /weightsync/* call of a round (all but begin, load_from_disk and the peer routes) carries
the round id that begin returned in the `X-Weightsync-Round` header; another id is refused (409).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from safetensors.torch import save

from weightsync.errors import PayloadError
from weightsync.interfaces.sampling import SamplingParams
from weightsync.net.caller import hung_up
from weightsync.net.fields import json_int
from weightsync.net.server import HttpError, Routes, Server, make_server as make_http_server
from weightsync.net.keys import resolve_key, warn_if_open
from weightsync.net.server import MiB
from weightsync.wire.frame import read_frame_header
from weightsync_reference.server.engine import ReferenceEngine
from weightsync_reference.server.generation import HungUp, VersionGate

log = logging.getLogger("weightsync_reference.server")
ROUND_HEADER = "X-Weightsync-Round"
SHARE_HEADER = "X-Weightsync-Share"
routes = Routes()
# a receive of a payload or relay body waits for this many bytes, or what its read still needs
# (`httpbody.BodyStream`: a member on a paced link is woken per 128 KiB, not per few segments)
GATHER = 128 << 10
JSON_CAP = 16 * MiB                     # announce headers list every tensor of a bucket


def _rid(h: Any) -> str | None:
    return h.headers.get(ROUND_HEADER)


@routes.add("GET", "/health", auth=False, max_body=0)
def _health(h: Any, q: dict) -> Any:
    return h.engine.health()


@routes.add("GET", "/info", max_body=0, keys=("rollout_key",))
def _info(h: Any, q: dict) -> Any:
    return h.engine.info()


@routes.add("GET", "/weights", max_body=0)
def _weights(h: Any, q: dict) -> Any:
    return save(h.engine.tensors(q.get("name", [])), metadata={"version": str(h.engine.version)})


def _int_or_none(v: Any, field: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise HttpError(400, f"{field} must be an integer, got {v!r}")
    return v


@routes.add("POST", "/generate", keys=("rollout_key",))
def _generate(h: Any, q: dict) -> Any:
    body = h.json_body()
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    ids = body.get("input_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise HttpError(400, "input_ids must be a list of integers")
    sampling = body.get("sampling")
    if sampling is None:                 # the short form: greedy, max_new_tokens only
        sampling = {"temperature": 0.0, "max_new_tokens": body.get("max_new_tokens", 16)}
    try:
        params = SamplingParams.model_validate(sampling)
    except ValidationError as e:
        raise HttpError(400, f"bad sampling parameters: {_explain(e)}") from None
    wait = body.get("wait", 0.0)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or wait < 0:
        raise HttpError(400, "wait must be a number of seconds >= 0")
    try:
        samples = h.engine.generate(
            ids, params, min_version=_int_or_none(body.get("min_version"), "min_version"),
            exact_version=_int_or_none(body.get("exact_version"), "exact_version"), wait=float(wait),
            gone=lambda: hung_up(h.connection))
    except VersionGate as e:
        raise HttpError(409, str(e), weight_version=e.held) from None
    except HungUp:
        h.close_connection = True
        raise HttpError(499, "the caller hung up; nothing was generated for it") from None
    first = samples[0]
    return {**first, "version": first["weight_version"], "samples": samples}


@routes.add("POST", "/score")
def _score(h: Any, q: dict) -> Any:
    body = h.json_body()
    ids = body.get("input_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise HttpError(400, "input_ids must be a list of integers")
    return h.engine.score(ids)


@routes.add("POST", "/weightsync/distrust", max_body=JSON_CAP)
def _distrust(h: Any, q: dict) -> Any:
    body = h.json_body()
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    h.engine.distrust(_int_or_none(body.get("version"), "version") or 0, str(body.get("reason", "")))
    return {"distrusted": h.engine.distrusted}


def _explain(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())


@routes.add("POST", "/pause")
def _pause(h: Any, q: dict) -> Any:
    body = h.json_body()
    h.engine.pause(str(body.get("mode", "abort")), body.get("lease"),
                   _int_or_none(body.get("after_tokens"), "after_tokens"))
    return {"status": "paused"}


@routes.add("POST", "/resume")
def _resume(h: Any, q: dict) -> Any:
    h.engine.resume()
    return {"status": "resumed"}


@routes.add("POST", "/weightsync/begin", max_body=JSON_CAP)
def _begin(h: Any, q: dict) -> Any:
    body = h.json_body()
    r = h.engine.begin(json_int(body.get("version"), "version"), body, body.get("lease"))
    return {"status": "begun", "round": r.id, "version": r.version, "lease": r.lease}


@routes.add("POST", "/weightsync/renew")
def _renew(h: Any, q: dict) -> Any:
    return h.engine.renew(_rid(h), h.json_body().get("lease"))


@routes.add("POST", "/weightsync/payload", max_body=lambda: 0)   # replaced per engine (make_server)
def _payload(h: Any, q: dict) -> Any:
    if h.engine.round is None or _rid(h) != h.engine.round.id:
        h.engine._current(_rid(h))        # refuse (409) before reading the body
    # the body is read straight into the round's staging tensors as it arrives, each piece
    # hashed while in cache (`ReceiveSession.apply_stream`); no whole-body buffer
    read_into = h.body_reader(GATHER)
    header, nbytes = read_frame_header(read_into, read_into.left)
    return {"digest": h.engine.apply_stream(_rid(h), header, read_into, nbytes)}


@routes.add("POST", "/weightsync/relay", auth=False, max_body=lambda: 0)   # replaced per engine
def _relay(h: Any, q: dict) -> Any:
    from weightsync.transports.http.member_relay import RELAY_HEADER, Tampered
    read_into = h.body_reader(GATHER)

    def cancel() -> None:                 # unblocks a read from a parent that stalled
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    try:
        return h.engine.relay(_rid(h), h.headers.get(RELAY_HEADER), read_into, read_into.left,
                              cancel)
    except Tampered as e:
        raise HttpError(422, str(e)) from None


@routes.add("POST", "/weightsync/deliver", max_body=JSON_CAP)
def _deliver(h: Any, q: dict) -> Any:
    body = h.json_body()
    kind, inner = body.get("kind") if isinstance(body, dict) else None, None
    if isinstance(body, dict):
        inner = body.get("body", {})
    if not isinstance(kind, str) or not kind or not isinstance(inner, dict):
        raise HttpError(400, 'a message is {"kind": "<transport>.<verb>", "body": {...}}')
    return h.engine.deliver(_rid(h), kind, inner)


@routes.add("POST", "/weightsync/end")
def _end(h: Any, q: dict) -> Any:
    return {"digests": {str(k): v for k, v in h.engine.end(_rid(h)).items()}}


@routes.add("POST", "/weightsync/commit")
def _commit(h: Any, q: dict) -> Any:
    h.engine.commit(_rid(h), json_int(h.json_body().get("version"), "version"))
    return {"version": h.engine.version}


@routes.add("POST", "/weightsync/abort")
def _abort(h: Any, q: dict) -> Any:
    h.engine.abort(_rid(h))
    return {"version": h.engine.version}


@routes.add("POST", "/weightsync/load_from_disk")
def _load_from_disk(h: Any, q: dict) -> Any:
    body = h.json_body()
    if "path" not in body or "version" not in body:
        raise PayloadError('load_from_disk needs {"path": DIR, "version": v}')
    version = json_int(body["version"], "version")
    path = Path(str(body["path"]))
    roots = h.load_roots
    real = path.resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise HttpError(403, f"load_from_disk of {path} is refused: it is not below a directory "
                             f"this engine was started with (--load-root); allowed: "
                             f"{[str(r) for r in roots] or 'none'}")
    older = body.get("allow_older", False)
    if not isinstance(older, bool):
        raise HttpError(400, f"allow_older must be true or false, got {older!r}")
    return {"version": h.engine.load_from_disk(str(real), version, older,
                                               body.get("signature"))}


@routes.add("POST", "/weightsync/peer/share")
def _share(h: Any, q: dict) -> Any:
    body = h.json_body()
    return h.engine.share(str(body.get("token", "")), float(body.get("ttl", 600)))


@routes.add("GET", "/weightsync/peer/manifest", auth=False, max_body=0)
def _peer_manifest(h: Any, q: dict) -> Any:
    return h.engine.peer_manifest(h.headers.get(SHARE_HEADER))


@routes.add("GET", "/weightsync/peer/bucket", auth=False, max_body=0)
def _peer_bucket(h: Any, q: dict) -> Any:
    try:
        index, version = json_int(q["index"][0], "index"), json_int(q["version"][0], "version")
    except (KeyError, ValueError, IndexError):
        raise HttpError(400, "peer/bucket needs ?index=i&version=v") from None
    parts = h.engine.peer_bucket(h.headers.get(SHARE_HEADER), index, version)
    return b"".join(bytes(p) for p in parts)


@routes.add("POST", "/weightsync/pull", max_body=JSON_CAP)
def _pull(h: Any, q: dict) -> Any:
    body = h.json_body()
    peer = body.get("peer")
    if not isinstance(peer, dict) or not peer.get("url") or not peer.get("token"):
        raise HttpError(400, 'pull needs {"peer": {"url": ..., "token": ..., "source": "http"}}')
    return {"version": h.engine.pull(peer)}


def make_server(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0,
                api_key: str | None = None, load_roots: list[str] | None = None,
                max_connections: int = 64, rollout_key: str | None = None) -> Server:
    """The engine's HTTP server. A payload may be as large as the whole model plus its header
    (a bucket never exceeds the model); every JSON route takes at most 16 MiB, others 1 MiB.
    `rollout_key` opens /generate and /info only (a rollout router's), never a weight route."""
    model_bytes = sum(t.numel() * t.element_size() for n in engine.model.store.names()
                      if (t := engine.model.store.get(n)) is not None)
    mine = Routes()
    mine.table.update(routes.table)
    payload = mine.table[("POST", "/weightsync/payload")]
    mine.table[("POST", "/weightsync/payload")] = type(payload)(payload.fn, True,
                                                                 model_bytes + JSON_CAP)
    fwd = mine.table[("POST", "/weightsync/relay")]     # the relay token is checked instead
    mine.table[("POST", "/weightsync/relay")] = type(fwd)(fwd.fn, False, model_bytes + JSON_CAP)
    roots = tuple(Path(r).resolve() for r in (load_roots or []))
    return make_http_server(mine, host, port, api_key=api_key, name=f"engine {engine.name}",
                            state={"engine": engine, "load_roots": roots,
                                   "rollout_key": rollout_key},
                            max_connections=max_connections)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8100, api_key: str | None = None,
          name: str | None = None, device: str = "cpu", *, api_key_file: str | None = None,
          load_roots: list[str] | None = None, fleet: str | None = None,
          fleet_key: str | None = None, advertise: str | None = None, verbosity: int = 0,
          fleet_credential_file: str | None = None,
          hmac_key_file: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, rollout_key_file: str | None = None,
          share_source: str = "http") -> None:
    from weightsync.plugins import load_components
    from weightsync_reference.server.model import load_model

    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from weightsync.wire.signing import load_key
    key = resolve_key(api_key, api_key_file)
    engine = ReferenceEngine(load_model(model_dir, device), load_components(), name or f"{host}:{port}",
                             hmac_key=load_key(None, hmac_key_file), share_source=share_source)
    rollout_key = resolve_key(None, rollout_key_file, env="WEIGHTSYNC_ROLLOUT_KEY")
    server = make_server(engine, host, port, key, load_roots, rollout_key=rollout_key)
    scheme = "http"
    if tls_cert:
        import ssl
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls_cert, tls_key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    real_port = server.server_address[1]
    engine.name = name or f"{host}:{real_port}"
    warn_if_open(host, key, f"the reference engine {engine.name}")
    url = advertise or f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{real_port}"
    member = None
    if fleet:
        from weightsync.fleets.member import Membership
        member = Membership(fleet, fleet_key, {"name": engine.name, "url": url,
                                               "adapter": {"kind": "reference"}, "api_key": key,
                                               "rollout_key": rollout_key},
                            version=lambda: engine.version, credential_file=fleet_credential_file)
        engine.membership = member
    stop = threading.Event()

    def shutdown(*_: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    print(f"weightsync reference engine serving {model_dir} ({engine.model.kind}) on {url}",
          flush=True)
    loop = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                            name="ws-serve", daemon=True)
    loop.start()
    try:
        if member is not None:
            member.start()                  # the registry checks our health: serve first
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        server.shutdown()
    finally:
        if member is not None:
            member.stop()
        engine.close()
        server.server_close()
        sys.stdout.flush()
