"""vLLM weight-transfer backend `weightsync` (runs inside every vLLM worker).

A server started with `--weight-transfer-config '{"backend": "weightsync"}'` receives through any
weightsync transport and decodes any weightsync encoding, over vLLM's own four-phase API:

  /init_weight_transfer_engine {"init_info": {"plan": {...}, "version": v, "engine_version": u}}
      picks the transport and encoding of the next round (also: "join"/"leave" a collective
      group, "load_from_disk" a checkpoint directory)
  /start_weight_update                          opens a round (nothing touches the model)
  /update_weights {"update_info": {"header": {...}, "fetch": {"url", "token", "nbytes"}}}   one
      payload; the body fetched in binary from the trainer's body server (http; with "relay"
      in the fetch: from the server above this one in a relay chain or tree, checked piece by
      piece and offered on to the servers below, `weightsync.transports.http.member_fetch`),
      or inline as "body_b64" (http, `bodies: inline`), or placed out of band by the transport
      (shm, collective: an announce): then neither
  /update_weights {"update_info": {"message": {"kind", "body"}, "reply": id}}   any other
      transport message: the round's transport receiving half takes it (`StagedRound.deliver`)
  /collective_rpc {"method": "weightsync_state"} -> the digests of what was staged (with
      "reply": id, the answer to that message)
  /finish_weight_update {"weight_version": "v"} loads the whole round in one layerwise reload

Every bucket is checked (name and shape against the served checkpoint, dtype, digest) when it
arrives; the model is only touched at finish, so a bad round leaves the previous version serving.

Rounds and leases: `leases.RoundLeases`.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weightsync.errors import PayloadError, PluginError
from weightsync.transports.collective import JoinGroup, LeaveGroup, _forget_groups
from weightsync.wire.checkpoint import read_checkpoint
from weightsync.wire.signing import load_key

from .guard import INSECURE_ENV, TOKEN_ENV, check_root, insecure, load_roots, load_token
from .leases import RoundLeases
from .relaying import relay_server
from .staging import CheckpointIndex, StagedRound, build_encoding, build_receiver

log = logging.getLogger("weightsync.vllm")


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    plan: dict[str, Any] | None = None          # {"transport": ref, "encoding": ref}
    version: int | None = None                  # the version the next round carries
    engine_version: int | None = None           # the version the engine holds now (delta base)
    join: dict[str, Any] | None = None          # collective: SGLang's init body
    leave: dict[str, Any] | None = None
    load_from_disk: dict[str, Any] | None = None  # {"path": dir, "allow_older"?, "signature"?}
    round: dict[str, Any] | None = None         # {"id": str, "lease": s}: the round begin opens
    renew: dict[str, Any] | None = None         # {"id": str, "lease": s}: extend its lease
    server: dict[str, Any] | None = None        # {"url": base, "headers": {...}}: for a lapse
    token: str | None = None                    # the backend's token ($WEIGHTSYNC_VLLM_TOKEN)


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    header: dict[str, Any] | None = None        # a payload header (weightsync's Payload.header())
    body_b64: str | None = None                 # the body inline (http transport, bodies: inline)
    fetch: dict[str, Any] | None = None         # {"url", "token", "nbytes"}: fetch the body (http)
    message: dict[str, Any] | None = None       # {"kind", "body"}: any transport's own message
    reply: str | None = None                    # where the worker keeps that message's answer
    abort: bool = False                         # drop the round; finish then loads nothing
    round: str | None = None                    # the id of the round this call belongs to
    token: str | None = None                    # the backend's token ($WEIGHTSYNC_VLLM_TOKEN)


class WeightSyncTransferEngine(RoundLeases,
                               WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        from weightsync.plugins import load_components
        self.components = load_components()
        self.index = CheckpointIndex(self.model_config.model)
        self.plan_keys: tuple[str, str] | None = None
        self.encoding: Any = None
        self.rx: Any = None
        self.next_version: int | None = None
        self.round: StagedRound | None = None
        self.committed: int | None = None
        self.replies: dict[str, dict[str, Any]] = {}   # message answers, until weightsync_state
        self.lock = threading.RLock()
        self.token = load_token()
        self.hmac_key = load_key()                # $WEIGHTSYNC_HMAC_KEY: payloads must be signed
        self.load_roots = load_roots()
        self.open = self.token is None and insecure()
        if self.token is None:
            log.warning("weightsync backend: no $%s is set: %s", TOKEN_ENV,
                        f"${INSECURE_ENV} lets anyone who reaches this server's weight-transfer "
                        f"routes change its weights" if self.open else
                        "every weight update is refused until the server is restarted with one")
        self.relay = relay_server(int(self.parallel_config.rank))   # fetch relays: what it feeds
        self.relayed = {"buckets": 0, "from_parent": 0, "from_trainer": 0, "fallbacks": []}
        threading.Thread(target=self._watch, name="weightsync-lease", daemon=True).start()
        log.info("weightsync backend ready: %d checkpoint tensors from %s",
                 len(self.index.specs), self.model_config.model)

    # -- init: plan, group membership, disk reloads -------------------------------------------
    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        self._authorize(init_info.token)
        with self.lock:
            self._init(init_info)

    def _authorize(self, token: str | None) -> None:
        """vLLM's --api-key does not cover the weight-transfer routes: the backend's own token
        must come with every init_info and update_info."""
        if self.token is None:
            if self.open:
                return
            raise PayloadError(f"this vLLM server has no ${TOKEN_ENV}: the weightsync backend "
                               f"refuses weight updates without a token of its own (vLLM's "
                               f"--api-key does not cover these routes); restart it with "
                               f"${TOKEN_ENV} or ${TOKEN_ENV}_FILE set and give the vllm adapter "
                               f"the same `token` (or ${INSECURE_ENV}=1 on a trusted host)")
        if not (isinstance(token, str) and hmac.compare_digest(token, self.token)):
            raise PayloadError(f"weightsync token {'missing' if token is None else 'wrong'}: this "
                               f"server was started with ${TOKEN_ENV}; give the vllm adapter the "
                               f"same token (option `token`)")

    def _init(self, init_info: WeightSyncInitInfo) -> None:
        if init_info.renew is not None:
            self._renew(init_info.renew)
        if init_info.server is not None:
            self.server = dict(init_info.server)
        if init_info.round is not None:
            self._open(init_info.round)
        if init_info.plan is not None:
            self._configure(init_info.plan)
        if init_info.version is not None:
            self.next_version = int(init_info.version)
        if init_info.engine_version is not None and self.encoding is not None \
                and hasattr(self.encoding, "receiving"):
            self.encoding.receiving(int(init_info.engine_version))
        if init_info.join is not None:
            if self.rx is None:
                raise PayloadError("join before any plan: send init_info.plan first")
            info = dict(init_info.join)
            info["rank_offset"] = int(info["rank_offset"]) + int(self.parallel_config.rank)
            self.rx.deliver(JoinGroup.kind, info, self.round or _NO_ROUND)
        if init_info.leave is not None:
            self._leave(init_info.leave)
        if init_info.load_from_disk is not None:
            self._load_from_disk(dict(init_info.load_from_disk))

    def _configure(self, plan: dict[str, Any]) -> None:
        tr_key = json.dumps(plan["transport"], sort_keys=True)
        enc_key = json.dumps(plan["encoding"], sort_keys=True)
        old = self.plan_keys or ("", "")
        if tr_key != old[0]:
            try:
                rx = build_receiver(plan["transport"], self.components)
            except PluginError:     # a transport plugin installed since this worker started
                from weightsync.plugins import load_components
                self.components = load_components()
                rx = build_receiver(plan["transport"], self.components)
            if self.rx is not None:
                self.rx.close()
            self.rx = rx
        if enc_key != old[1]:
            self.encoding = build_encoding(plan["encoding"], self.components)
        self.plan_keys = (tr_key, enc_key)

    def _leave(self, info: dict[str, Any]) -> None:
        """Leave the trainer's group (best effort, like the reference engine's receivers); a
        round whose transport is no longer the group's forgets every group this worker is in."""
        if self.rx is not None:
            try:
                self.rx.deliver(LeaveGroup.kind, info, self.round or _NO_ROUND)
                return
            except PayloadError:
                pass
        _forget_groups()

    def _load_from_disk(self, spec: dict[str, Any]) -> None:
        """The reference engine's rules: a newer version only (unless `allow_older`), and with
        an HMAC key only a checkpoint signed as that version."""
        from weightsync.wire.signing import check_checkpoint
        path = str(spec["path"])
        if self.round is not None:
            raise PayloadError("an update round is open; finish or abort it before reloading from disk")
        v, held = self.next_version, self.committed
        if v is not None and held is not None and v <= held and not spec.get("allow_older"):
            raise PayloadError(f"this engine holds version {held}; loading version {v} from disk "
                               f"would move it back (or give one version label two weight sets); "
                               f"load a newer version, or pass allow_older to roll back on purpose")
        check_root(path, self.load_roots)
        named = read_checkpoint(path, self.index.check)     # every name and shape checked first
        check_checkpoint(self.hmac_key, path, -1 if v is None else v, named, spec.get("signature"))
        self._load(named)
        self.index.live.update(named)                 # the delta base is now that checkpoint
        self.committed = self.next_version

    # -- the round --------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        if not self._live():
            raise PayloadError("no weightsync round is open: the init_info that opens a round "
                               "(plan + round id + lease) must come first; the weightsync 'vllm' "
                               "adapter sends it")
        if self.encoding is None or self.rx is None:
            raise PayloadError("no weightsync plan: POST /init_weight_transfer_engine with "
                               "init_info.plan (the weightsync 'vllm' adapter does this) first")
        if self.round is not None:
            self._ended(self.round)
        self.round = StagedRound(self.index, self.encoding, self.rx, self.next_version, self.hmac_key)
        self.round.rid = self.round_id
        self.round.relay = self.relayed          # counted across rounds

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        self._authorize(update_info.token)
        r = self.round
        if r is None and update_info.abort:       # the round already ended on an error
            with self.lock:
                if update_info.round in (None, self.round_id):
                    self.round_id = None
            return
        if r is None:
            raise PayloadError("no weightsync round is open; call /start_weight_update first")
        if update_info.abort:
            if update_info.round is not None and self.round_id not in (None, update_info.round):
                self._check(update_info.round)          # another trainer's round: refused
            r.aborted = True
            r.staged.clear()
            self._ended(r)
            with self.lock:
                self.round_id = None
            return
        self._check(update_info.round)
        header = update_info.header
        if header is None and update_info.message is None:
            raise PayloadError("update_info needs a payload 'header', a 'message' or 'abort': true")
        body = None
        if update_info.body_b64 is not None:
            body = memoryview(base64.b64decode(update_info.body_b64, validate=True))
        try:
            if header is None:                 # a transport's own message
                self._deliver(r, update_info.message or {}, update_info.reply)
            elif update_info.fetch is not None:
                r.stage_fetched(header, update_info.fetch, self.relay)
            else:
                r.stage(header, body)
        except BaseException:
            self._ended(r)
            self.round = None       # vLLM ends the session on an error; so does the round
            with self.lock:
                self.round_id = None
            raise

    def _deliver(self, r: StagedRound, message: dict[str, Any], reply: str | None) -> None:
        """A transport's own message: its receiving half parses it; the answer is kept under
        `reply` for the adapter's next `weightsync_state` (vLLM's route returns nothing)."""
        kind, body = message.get("kind"), message.get("body")
        if not isinstance(kind, str) or not isinstance(body, dict):
            raise PayloadError(f"update_info.message needs a 'kind' and a 'body' object: {message}")
        answer = r.deliver(kind, body)
        if reply is not None:
            with self.lock:
                while len(self.replies) >= 64:             # answers nobody asked for
                    self.replies.pop(next(iter(self.replies)))
                self.replies[str(reply)] = dict(answer or {})

    def digests(self) -> dict[int, str]:
        if self.round is None:
            raise PayloadError("no weightsync round is open (it failed or was never started)")
        return self.round.end()

    def finish_weight_update(self) -> None:
        r, self.round = self.round, None
        with self.lock:
            if r is not None and r.rid == self.round_id:
                self.round_id = None          # a stale session's finish leaves a new round be
        if r is not None:
            self._ended(r)
        if r is None or r.aborted:
            return
        r.end()
        self._load(r.staged)
        self.index.live.update(r.staged)
        self.committed = r.version
        if r.version is not None:
            r.encoding.commit(r.version)
        log.info("weightsync: loaded %d tensors (version %s)", len(r.staged), r.version)

    def _ended(self, r: StagedRound) -> None:
        """The round is over: stop offering its bodies to the engines it fed."""
        if self.relay is not None:
            for bid in r.offered:
                self.relay.withdraw_id(bid)
        r.offered = []

    def _load(self, named: dict[str, torch.Tensor]) -> None:
        """vLLM's layerwise reload: parameters go back to checkpoint layout on the meta device,
        `load_weights` fills them, and processing (CPU packing, quantization) runs again in
        place. Works where plain `load_weights` fails (packed CPU linears)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
            try:
                # every vLLM model class defines load_weights (typed here as a plain Module)
                cast(Any, self.model).load_weights(iter(list(named.items())))
            finally:
                finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.round = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.rx is not None:
            self.rx.close()
            self.rx = None
        self.plan_keys = None


class _NoRound:
    """What a message outside a round stages into: nothing (a join needs no staging)."""

    def apply(self, header: Any, body: memoryview | None = None) -> str:
        raise PayloadError("no weightsync round is open; call /start_weight_update first")


_NO_ROUND = _NoRound()


def _weightsync_state(self: Any, digests: bool = True, reply: str | None = None) -> dict[str, Any]:
    """Worker RPC (POST /collective_rpc {"method": "weightsync_state"}): the digests of the open
    round, computed here in the worker from what was staged (`digests` false: only the round's
    id and lease, for a trainer that finds a round open); `reply`: also the answer this worker
    gave the message sent with that reply id."""
    engine = getattr(getattr(self, "worker", self), "weight_transfer_engine", None)
    if not isinstance(engine, WeightSyncTransferEngine):
        raise RuntimeError("this vLLM server does not run the weightsync backend; start it with "  # noqa: TRY004
                           "--weight-transfer-config '{\"backend\": \"weightsync\"}'")
    live = engine._live()
    with engine.lock:
        answer = engine.replies.pop(str(reply), None) if reply is not None else None
    return {"reply": answer,"digests": {str(k): v for k, v in engine.digests().items()} if digests else None,
            "committed": engine.committed, "rank": int(engine.parallel_config.rank),
            "round": engine.round_id if live else None, "lapsed": engine.lapsed,
            "relay_url": engine.relay.url if engine.relay is not None else None,
            "relay": dict(engine.relayed),
            "expires_in": round(engine.expires - time.monotonic(), 3) if live else None}


def _install_rpc() -> None:
    """Make `weightsync_state` callable through collective_rpc without a worker extension."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase
    if not hasattr(WorkerWrapperBase, "weightsync_state"):
        setattr(WorkerWrapperBase, "weightsync_state", _weightsync_state)


_install_rpc()
