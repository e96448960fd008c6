"""Adapter `vllm`: drives a live vLLM server (OpenAI entrypoint, VLLM_SERVER_DEV_MODE=1) over
vLLM's native weight-transfer routes. With the server's `weightsync` backend it takes every
weightsync transport: http (the payload body in binary: /update_weights carries a one-time URL on
the trainer's own body server and the worker fetches the bytes straight into its staging
buffers; `bodies: inline` puts them base64 inside the JSON instead), shm (`Announce`), collective
(the worker joins the trainer's group), disk (reload a checkpoint directory), and any other
transport's messages: the backend hands them to the round's transport receiving half, so a
transport plugin installed in the vLLM server works with no change here (`deliver`).
It can also drive vLLM's own `nccl` / `ipc` backends (`native_*`, bodies from `native.py`).
Rollouts are `generation.VllmSampler`; starting servers is `launch.VllmLauncher`."""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from weightsync.errors import EngineError
from weightsync.interfaces import Announce, Endpoint, EngineStatus, HttpAdapter, Message
from weightsync.net.client import json_of
from weightsync.transports.collective import JoinGroup, LeaveGroup
from weightsync.transports.http import FetchPayload

from .bodies import render_fetch, render_update_weights
from .generation import distrust_on, parse_version as _parse_version, score_on
from .guard import TOKEN_ENV

log = logging.getLogger(__name__)
FLAG = "--weight-transfer-config '{\"backend\": \"weightsync\"}'"


class VllmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls")
    payload_timeout: float = Field(600.0, gt=0, description="seconds for a payload, join, pause(wait) or finish")
    reset_prefix_cache: bool = Field(True, description="drop cached prefixes after new weights land")
    group_size: int | None = Field(None, ge=1, description="ranks in a collective group; None: ask /get_world_size")
    bodies: Literal["fetch", "inline"] = Field(
        "fetch", description="http transport: fetch (the worker pulls each payload body in binary "
                            "from the trainer's body server) or inline (base64 in the JSON)")
    body_host: str = Field("127.0.0.1", description="address the trainer's body server binds to "
                                                    "(loopback: engines on this host)")
    body_advertise: str | None = Field(None, description="address the workers reach the body "
                                                         "server at (default: body_host)")
    token: str | None = Field(None, description="the weightsync backend's token (the server's "
                                                "$WEIGHTSYNC_VLLM_TOKEN); default: this "
                                                "process's $WEIGHTSYNC_VLLM_TOKEN")


class VllmAdapter(HttpAdapter):
    name = "vllm"
    Options = VllmOptions
    accepts = None                      # the backend runs weightsync's receiver: any message
    encodings = None                    # the weightsync backend decodes any encoding
    # vLLM's three; "keep" has vLLM preempt the held requests (at the pause in 0.32, else at
    # commit: their KV recomputed with the new weights), "keep_stale_kv" holds their old KV
    pause_modes = ("abort", "wait", "keep", "keep_stale_kv")
    layout = "safetensors"
    staging = True                       # the backend stages a whole round; finish swaps it in
    verification = "digest"              # the workers hash what they staged
    leases = True                        # the backend holds rounds under a lease

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self._engine_version: int | None = None
        self._group_size: int | None = self.options.group_size
        self._order = threading.Condition()
        self._next_index = 0        # the bucket whose announce goes out next
        self.round_id: str | None = None
        self._bodies: Any = None    # weightsync.net.bodyserver.BodyServer, started on first use
        self._published: list[dict[str, Any]] = []
        self.token = self.options.token or os.environ.get(TOKEN_ENV) or None
        self._source: tuple[str | None, str | None] | None = None   # (round, relay url)
        self._mode: str | None = None   # the pause mode of the open pause

    # -- HTTP ---------------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, body: Any = None, params: Any = None,
              timeout: float | None = None, token: bool = True) -> Any:
        if token and self.token and isinstance(body, dict):    # the backend's own token, in its infos
            for key in ("init_info", "update_info"):
                if isinstance(body.get(key), dict):
                    body = {**body, key: {**body[key], "token": self.token}}
        try:
            resp = self.request(method, path, timeout=timeout, params=params,
                                json=body if method == "POST" else None)
        except EngineError as e:
            raise self._explain(e, path) from None
        return json_of(resp, self.engine_name)

    def _explain(self, e: EngineError, path: str) -> EngineError:
        d = e.detail
        if "HTTP 404" in d:
            hint = (f"route {path} does not exist: start the vLLM server with VLLM_SERVER_DEV_MODE=1 "
                    f"(vLLM >= 0.32 serves the weight-transfer and pause routes only in dev mode)")
        elif "Weight transfer not configured" in d or "weight_transfer_config" in d:
            hint = f"the vLLM server has no weight-transfer backend: start it with {FLAG}"
        elif "Invalid init_info" in d or "Invalid update_info" in d:
            hint = f"the vLLM server runs another weight-transfer backend: start it with {FLAG}"
        elif "weightsync token" in d:
            hint = ("give the vllm adapter the server's token: option `token`, or "
                    f"${TOKEN_ENV} in the trainer's environment")
        elif "weightsync_state" in d and "not implemented" in d:
            hint = f"the weightsync backend is not loaded in the vLLM workers: start the server with {FLAG}"
        else:
            return e
        return type(e)(self.engine_name, f"{d}\n  -> {hint}")

    def _post(self, path: str, body: Any = None, timeout: float | None = None, params: Any = None,
              token: bool = True) -> Any:
        return self._call("POST", path, body=body if body is not None else {}, params=params,
                          timeout=timeout, token=token)

    def _init(self, init_info: Mapping[str, Any], timeout: float | None = None) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": dict(init_info)},
                   timeout or self.options.payload_timeout)

    # -- control ------------------------------------------------------------------------------
    def health(self) -> EngineStatus:
        self._call("GET", "/health")
        raw = (self._call("GET", "/weight_info") or {}).get("weight_version")
        self._engine_version = version = _parse_version(raw)
        return EngineStatus(version, False, {"weight_version": raw})

    def check_access(self) -> None:
        """vLLM's `--api-key` (`GET /v1/models`) and the backend's token (an empty init_info,
        which the backend checks and then does nothing with)."""
        self._call("GET", "/v1/models")
        self._init({})

    def is_paused(self) -> bool:
        return bool((self._call("GET", "/is_paused") or {}).get("is_paused"))

    def pause(self, mode: str) -> None:
        if mode not in self.pause_modes:
            raise ValueError(f"pause mode {mode!r}: vLLM takes one of {list(self.pause_modes)}")
        stale = {"mode": "keep", "clear_cache": "false"}   # vLLM 0.32's keep preempts otherwise
        self._post("/pause", params=stale if mode == "keep_stale_kv" else {"mode": mode},
                   timeout=self.options.payload_timeout)
        self._mode = mode

    def resume(self) -> None:
        self._post("/resume")
        self._mode = None

    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        """Open a round: the backend takes its id and lease (and refuses while another trainer's
        round is live), then vLLM's update session starts. A session left open by a round whose
        lease lapsed is closed first (its finish loads nothing)."""
        with self._order:
            self._next_index = 0
        rid = uuid.uuid4().hex[:16]
        info: dict[str, Any] = {"plan": dict(plan), "version": int(version),
                                "round": {"id": rid, "lease": self.lease},
                                "server": {"url": self.base, "headers": dict(self.headers)}}
        if self._engine_version is not None:
            info["engine_version"] = self._engine_version
        self._init(info)
        self.round_id = rid
        try:
            self._post("/start_weight_update", timeout=self.options.payload_timeout)
        except EngineError as e:
            if "already active" not in e.detail:
                raise
            self._post("/finish_weight_update", {})   # a dead round's session: close it
            self._post("/start_weight_update", timeout=self.options.payload_timeout)

    def renew(self) -> None:
        if self.round_id is not None:
            self._init({"renew": {"id": self.round_id, "lease": self.lease}},
                       timeout=max(0.5, self.lease / 3))

    def round_state(self) -> dict[str, Any]:
        return {"round": self.round_id}

    def join_round(self, state: Mapping[str, Any]) -> None:
        """Another trainer rank's round (its payloads name it; the backend takes any order)."""
        self.round_id = state.get("round")

    def end(self) -> dict[int, str]:
        self._withdraw()
        body = self._post("/collective_rpc", {"method": "weightsync_state",
                                              "kwargs": {"digests": True},
                                              "timeout": self.options.payload_timeout},
                          timeout=self.options.payload_timeout) or {}
        results = body.get("results") if isinstance(body, dict) else None
        if not results or not all(isinstance(r, dict) and "digests" in r for r in results):
            raise EngineError(self.engine_name, f"weightsync_state answered without digests: {body}")
        per_rank = [{int(k): str(v) for k, v in r["digests"].items()} for r in results]
        if any(d != per_rank[0] for d in per_rank[1:]):
            raise EngineError(self.engine_name, "the workers staged different bytes: "
                              f"{[r.get('rank') for r in results]} disagree on the round's digests")
        return per_rank[0]

    def commit(self, version: int) -> None:
        self._post("/finish_weight_update", {"weight_version": str(int(version))},
                   timeout=self.options.payload_timeout)
        self.round_id = None
        self._engine_version = int(version)
        running = self._mode == "keep"   # requests held over the swap: recompute their KV
        if self.options.reset_prefix_cache or running:
            try:     # cached prefixes (and held requests) hold KV computed with the old weights
                self._post("/reset_prefix_cache",
                           params={"reset_running_requests": "true"} if running else None)
            except EngineError as e:
                if running:     # held requests would go on over the old weights' KV
                    raise EngineError(self.engine_name, f"vLLM did not preempt the held requests: "
                                      f"{e.detail}; pause with 'abort' (or 'keep_stale_kv')") from None
                log.warning("engine %s: reset_prefix_cache failed: %s", self.engine_name, e)

    def abort(self) -> None:
        """Drop the staged round: mark it aborted, then close vLLM's session (finish loads
        nothing for an aborted round). Either call fails harmlessly when no round is open."""
        self._withdraw()
        if self.round_id is None:
            return
        for path, body in (("/update_weights", {"update_info": {"abort": True, "round": self.round_id}}),
                           ("/finish_weight_update", {})):
            try:
                self._post(path, body, timeout=self.options.payload_timeout)
            except EngineError as e:
                log.info("engine %s: %s during abort: %s", self.engine_name, path, e.detail)
        self.round_id = None

    # -- transports ---------------------------------------------------------------------------
    def payload_endpoint(self) -> Endpoint:
        render = (self._render_fetch if self.options.bodies == "fetch"
                  else functools.partial(render_update_weights, round_id=self.round_id,
                                         token=self.token))
        return Endpoint(self.base + "/update_weights", dict(self.headers),
                        self.bounded(self.options.payload_timeout), render=render)

    def _render_fetch(self, header: dict[str, Any], body: torch.Tensor) -> tuple[list[Any], str]:
        """Publish `body` for one fetch by this engine's worker (the previous one is withdrawn:
        payloads reach vLLM one after another, each POST answered before the next is built)."""
        if self._bodies is None:
            from weightsync.net.bodyserver import BodyServer
            self._bodies = BodyServer(self.options.body_host, advertise=self.options.body_advertise,
                                      timeout=self.options.payload_timeout)
        self._withdraw()
        ref = self._bodies.publish(body.contiguous() if body.numel() else body)
        self._published.append(ref)
        return render_fetch(header, ref, self.round_id, self.token)

    def relay_source(self) -> str | None:
        """The relay body server of the worker of rank 0 (asked once per round: a restarted
        server has another port); None with `bodies: inline` or where relaying is off."""
        if self.options.bodies != "fetch":
            return None
        if self._source is None or self._source[0] != self.round_id:
            body = self._post("/collective_rpc", {"method": "weightsync_state",
                                                  "kwargs": {"digests": False}}) or {}
            ranks = [r for r in (body.get("results") or []) if isinstance(r, dict)]
            first = min(ranks, key=lambda r: int(r.get("rank", 0)), default={})
            url = first.get("relay_url")
            self._source = (self.round_id, str(url) if url else None)
        return self._source[1]

    def _withdraw(self) -> None:
        if self._bodies is not None:
            for ref in self._published:
                self._bodies.withdraw(ref)
        self._published = []

    def deliver(self, message: Message) -> Mapping[str, Any]:
        """One transport message, in the open round. The four vLLM routes its own fields for
        (announce and fetch in update_info, join and leave in init_info) go there; any other kind
        goes whole in update_info's "message", and the worker hands it to the round's transport
        receiving half: its answer is read back through `weightsync_state`."""
        wait = message.wait if message.wait is not None else self.options.payload_timeout
        if isinstance(message, Announce):
            self._announce(message.body, wait)
        elif isinstance(message, JoinGroup):
            self._init({"join": dict(message.body)}, wait)
        elif isinstance(message, LeaveGroup):
            try:                                 # best effort, as the transport expects
                self._init({"leave": dict(message.body)}, timeout=self.options.timeout)
            except EngineError as e:
                log.info("engine %s: leaving group failed: %s", self.engine_name, e.detail)
        elif isinstance(message, FetchPayload):  # a body fetched by reference (fetch relays)
            self._post("/update_weights", {"update_info": {
                "round": self.round_id, "header": dict(message.body["header"]),
                "fetch": dict(message.body["fetch"])}}, timeout=wait)
        else:
            return self._generic(message, wait)
        return {}

    def _generic(self, message: Message, wait: float) -> Mapping[str, Any]:
        """A message this adapter has no route for: vLLM's /update_weights answers nothing of
        its own, so the worker keeps its answer under `reply` for one `weightsync_state` call."""
        reply = uuid.uuid4().hex[:16]
        self._post("/update_weights", {"update_info": {"round": self.round_id,
                                                       "message": message.wire(),
                                                       "reply": reply}}, timeout=wait)
        body = self._post("/collective_rpc", {"method": "weightsync_state",
                                              "kwargs": {"digests": False, "reply": reply}}) or {}
        ranks = [r for r in (body.get("results") or []) if isinstance(r, dict)]
        first = min(ranks, key=lambda r: int(r.get("rank", 0)), default={})
        got = first.get("reply")
        return got if isinstance(got, Mapping) else {}

    def _announce(self, header: Mapping[str, Any], wait: float) -> None:
        """One out-of-band payload. Announces leave in bucket order, each after the previous one
        returned: a transport keeps two in flight, and two concurrent HTTP requests can reach
        vLLM's engine in either order, while the worker must take the broadcasts in the order
        rank 0 sends them (a swap hands bucket i's bytes to bucket i+1's receive)."""
        index = int(header.get("index", 0))
        with self._order:
            if not self._order.wait_for(lambda: index <= self._next_index, timeout=wait):
                raise EngineError(self.engine_name, f"bucket {index} was announced, but bucket "
                                  f"{self._next_index} never was; the round is incomplete")
        try:
            self._post("/update_weights", {"update_info": {"header": dict(header),
                                                           "round": self.round_id}},
                       timeout=wait)
        finally:
            with self._order:
                self._next_index = max(self._next_index, index + 1)
                self._order.notify_all()

    def group_size(self) -> int:
        if self._group_size is None:
            body = self._call("GET", "/get_world_size") or {}
            self._group_size = int(body.get("world_size", 1))
        return self._group_size

    def score(self, ids: list[int]) -> tuple[list[float], int]:
        """The logprob of each token of `ids` after the first (vLLM's `prompt_logprobs`), and the
        version that computed them: what the probe compares with the trainer's own."""
        return score_on(self, ids)

    def distrust(self, version: int, reason: str) -> bool:
        """After a failed probe: no rollouts from `version` (`generation.distrust_on`)."""
        return distrust_on(self, version, reason)

    def load_from_disk(self, path: str, version: int, allow_older: bool = False,
                       signature: Mapping[str, Any] | None = None) -> None:
        """Reload a whole checkpoint directory on the engine's host and set `version`. With the
        weightsync backend every name and shape is checked before anything loads (and the delta
        base moves to the new checkpoint), a version older than the one held is refused unless
        `allow_older`, and a backend with an HMAC key needs `signature`
        (weightsync.wire.signing.checkpoint_signature) or a signed directory; otherwise vLLM's own
        reload_weights does it."""
        spec: dict[str, Any] = {"path": str(path), "allow_older": bool(allow_older)}
        if signature is not None:
            spec["signature"] = dict(signature)
        try:
            self._init({"version": int(version), "load_from_disk": spec})
        except EngineError as e:
            if "start it with" not in e.detail:
                raise
            self._post("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(path), "is_checkpoint_format": True},
                                           "timeout": self.options.payload_timeout},
                       timeout=self.options.payload_timeout)
        self._post("/update_weight_version", {"new_version": str(int(version))})
        self._engine_version = int(version)

    # -- vLLM's own backends (nccl, ipc): bodies from weightsync_vllm.native --------------------
    def native_init(self, init_info: Mapping[str, Any]) -> None:
        """POST /init_weight_transfer_engine; for nccl it blocks until the trainer joins, so
        call it from a thread while rank 0 builds its group."""
        self._post("/init_weight_transfer_engine", {"init_info": dict(init_info)},
                   timeout=self.options.payload_timeout, token=False)

    def native_start(self) -> None:
        self._post("/start_weight_update", timeout=self.options.payload_timeout)

    def native_update(self, update_info: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:
        """One /update_weights chunk (nccl: from a thread, while rank 0 broadcasts)."""
        body = [dict(u) for u in update_info] if isinstance(update_info, list) else dict(update_info)
        self._post("/update_weights", {"update_info": body}, timeout=self.options.payload_timeout,
                   token=False)

    def native_finish(self, version: int | None) -> None:
        self._post("/finish_weight_update",
                   {"weight_version": str(int(version))} if version is not None else {},
                   timeout=self.options.payload_timeout)

    def close(self) -> None:
        super().close()
        if self._bodies is not None:
            self._bodies.close()
            self._bodies = None

