"""Adapter `lmdeploy`: drives an LMDeploy api_server through its own routes
(docs/engines.md, LMDeploy): `/update_weights` (same host, tensor handles), the collective
routes (`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`, onto which `deliver` translates the `collective` transport's
`JoinGroup`, `Broadcast` and `LeaveGroup`: LMDeploy does not run weightsync's receiver) and
`/sleep` / `/wakeup`. Rollouts are `generation.LmdeploySampler`.

What LMDeploy lacks, and what this adapter does about it:
- No pause route. Pausing is `/sleep?level=L` (cancels every session: the "abort" mode) then
  `/wakeup?tags=weights`; resuming is `/wakeup?tags=kv_cache`.
- No weight-version route. The version is remembered per engine URL in the trainer process
  (`versions`); a new trainer process starts from 0 and resends everything, which is harmless
  because LMDeploy only ever takes whole weights (encodings raw and cast). For rollouts
  (`committed_version`, the sampler) an engine this process committed nothing to has no known
  version (None), never an assumed 0.
- No read-back and no abort of an update. `finished=true` rides on the very last call of a sync
  and is the only call that completes it. LMDeploy's PyTorch backend writes each call straight
  into the live parameters, so after a sync fails part-way the engine holds a mix: the adapter
  then never wakes the KV cache (inference keeps answering 503) and the next successful sync,
  which resends every weight, wakes it. With sleep_level 2 the old weights are gone as soon as
  the engine sleeps, so any failed round leaves it asleep.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from weightsync.errors import ConfigError, EngineError, WeightSyncError
from weightsync.net.client import json_of
from weightsync.interfaces import (AckedRound, Encoding, EngineStatus, HttpAdapter, JoinsGroups,
                                   Message, Payload, Transport)
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup

from .segments import LayerGrouper, Segment, flattened_runs, plain
from .serialize import serialize_flattened, serialize_plain

log = logging.getLogger(__name__)
BACKENDS = ("pytorch", "turbomind")

versions: dict[str, int] = {}
"""Weight version per engine URL, kept in the trainer process (LMDeploy has no version route)."""
_versions_lock = threading.Lock()


class LmdeployOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str = Field("pytorch", description="the engine's backend: pytorch or turbomind")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks of the engine")
    flattened: bool = Field(True, description="/update_weights with load_format flattened_bucket "
                                              "(one call per dtype run); false: plain named tensors")
    sleep_level: Literal[1, 2] = Field(1, description="/sleep level used to pause: 1 keeps the old "
                                                      "weights (offloaded), 2 discards them")
    ipc_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="where /update_weights tensors live: auto = cuda when available")
    layer_pattern: str = Field(r"\.layers\.(\d+)\.", description="TurboMind: decoder layer index regex")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls")
    payload_timeout: float = Field(600.0, gt=0, description="seconds for one weight call or group join")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v not in BACKENDS:
            raise ValueError(f"{v!r} is not an LMDeploy backend; use 'pytorch' (every weight route) "
                             f"or 'turbomind' (plain /update_weights only)")
        return v


class LmdeployAdapter(HttpAdapter):
    name = "lmdeploy"
    Options = LmdeployOptions
    accepts = (Broadcast, JoinGroup, LeaveGroup)  # collective's messages, on LMDeploy's own routes
    encodings = frozenset({"raw", "cast"})
    pause_modes = ("abort",)
    layout = "flat_per_dtype"
    staging = False                  # every call writes straight into the live parameters
    verification = "ack"             # LMDeploy cannot read its weights back: acknowledged only

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self._lock = threading.Lock()      # one /update_weights call at a time, in order
        self._reset_round()
        self._paused = False
        self._weights_whole = True         # False once sleep level 2 dropped them or a call landed

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def check(cls, options: BaseModel, transport: type[Transport], encoding: type[Encoding]) -> None:
        o: LmdeployOptions = options  # type: ignore[assignment]
        group = JoinsGroups in transport.requires
        if o.backend == "turbomind" and group:
            raise ConfigError("LMDeploy's TurboMind backend has no collective weight routes (they "
                              "answer 501); use transport 'lmdeploy_ipc' with flattened: false, or "
                              "backend 'pytorch' for the collective path")
        if o.backend == "turbomind" and o.flattened:
            raise ConfigError("LMDeploy's TurboMind backend takes only plain /update_weights "
                              "payloads, one decoder layer per call; set flattened: false (transport "
                              "'lmdeploy_ipc'), or use backend 'pytorch' for flattened buckets")
        if group and not o.flattened:
            raise ConfigError("transport 'collective' broadcasts one buffer per dtype, which LMDeploy "
                              "reads only with load_format flattened_bucket; set flattened: true, or "
                              "use transport 'lmdeploy_ipc' for plain payloads")

    # -- HTTP --------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, *, params: Any = None,
                 timeout: float | None = None) -> Any:
        """Every LMDeploy POST route requires Content-Type: application/json (`json=` sets it),
        even /sleep and /wakeup whose arguments are query parameters."""
        kw: dict[str, Any] = {"params": params}
        if method == "POST":
            kw["json"] = body if body is not None else {}
        try:
            resp = self.request(method, path, timeout=timeout, **kw)
        except EngineError as e:
            if "HTTP 500" in e.detail:
                raise EngineError(self.engine_name, f"{e.detail} (LMDeploy answers a bare 500 when "
                                  f"the engine raised; its server log has the traceback)") from None
            raise
        return json_of(resp, self.engine_name)

    def _checked(self, path: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Group routes answer {"success": bool, "message": str}; a false success is an error."""
        out = self._request("POST", path, dict(body), timeout=timeout)
        if not isinstance(out, dict) or out.get("success") is not True:
            msg = out.get("message") if isinstance(out, dict) else out
            raise EngineError(self.engine_name, f"POST {path} failed: {msg}")
        return out

    # -- control -----------------------------------------------------------------------------
    def health(self) -> EngineStatus:
        body = self._request("GET", "/is_sleeping") or {}
        with _versions_lock:
            v = versions.get(self.base, 0)
        return EngineStatus(v, bool(body.get("is_sleeping")), {"is_sleeping": body.get("is_sleeping"),
                                                              "version_source": "adapter"})

    def committed_version(self) -> int | None:
        """The version this process last committed to this engine; None when it committed none
        (LMDeploy itself has no version, so nothing else is known): the sampler's version."""
        with _versions_lock:
            return versions.get(self.base)

    def pause(self, mode: str) -> None:
        if mode not in self.pause_modes:
            raise WeightSyncError(f"LMDeploy cannot pause in mode {mode!r}: its only pause is /sleep, "
                                  f"which cancels every session; use 'abort'")
        if not self._paused and (self._request("GET", "/is_sleeping") or {}).get("is_sleeping"):
            # asleep before we paused it: a failed sync of another trainer process, or TurboMind's
            # empty_init start. Its weights are not known to be whole, so only a sync wakes it.
            self._weights_whole = False
        self._request("POST", "/sleep", params={"level": self.options.sleep_level})
        self._paused = True
        if self.options.sleep_level == 2:
            self._weights_whole = False
        self._request("POST", "/wakeup", params={"tags": "weights"})

    def resume(self) -> None:
        if not self._weights_whole:
            raise EngineError(self.engine_name, "left asleep: its weights are incomplete (a sync "
                              "failed after weights were sent, or sleep level 2 dropped them); "
                              "the next successful push resends every weight and wakes it")
        self._request("POST", "/wakeup", params={"tags": "kv_cache"})
        self._paused = False

    # -- one round ---------------------------------------------------------------------------
    def _reset_round(self) -> None:
        self._version: int | None = None
        self._acked = AckedRound()
        self._finished = False
        self._grouper = LayerGrouper(self.options.layer_pattern)

    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        kind = (plan.get("transport") or {}).get("kind")
        if kind not in (None, "lmdeploy_ipc", "collective"):
            raise WeightSyncError(f"LMDeploy receives over 'lmdeploy_ipc' or 'collective', not {kind!r}")
        self._reset_round()
        self._version = version

    def end(self) -> dict[int, str]:
        """The digest of every bucket LMDeploy acknowledged in full. LMDeploy cannot show its
        weights, so this proves delivery and layout (every tensor of the bucket went out in
        acknowledged calls), not the engine's bytes."""
        if not self._finished:
            raise EngineError(self.engine_name, "the sync ended before LMDeploy acknowledged the "
                              "call carrying finished=true; its new weights were not completed")
        return self._acked.digests()

    def commit(self, version: int) -> None:
        if not self._finished:
            raise EngineError(self.engine_name, "cannot commit: LMDeploy never acknowledged finished=true")
        with _versions_lock:
            versions[self.base] = version
        self._weights_whole = True

    def abort(self) -> None:
        """LMDeploy has no route that undoes loaded calls; nothing is sent. If any call landed
        the engine stays asleep (see resume) until a whole sync succeeds."""
        if not self._weights_whole:
            log.warning("engine %s: sync aborted after weights were sent; it stays asleep until the "
                        "next successful sync", self.engine_name)
        self._reset_round()

    # -- lmdeploy_ipc: /update_weights -------------------------------------------------------
    def _device(self) -> torch.device:
        d = self.options.ipc_device
        if d == "auto":
            d = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(d)

    def _segments(self, payload: Payload) -> list[Segment]:
        o = self.options
        if o.backend == "turbomind":
            from weightsync.wire.frame import unpack
            return list(self._grouper.feed(list(unpack(payload.body)[0]), payload.last))
        if o.flattened:
            return flattened_runs(payload.body)
        return [plain(payload.body)]

    def _body(self, seg: Segment, finished: bool) -> dict[str, Any]:
        dev = self._device()
        ranks = 1 if self.options.backend == "turbomind" else self.options.tp_size
        if seg.flat is not None:
            flat = seg.flat if seg.flat.device == dev else seg.flat.to(dev)
            # one string per rank: each rank opens its own handles
            data = [serialize_flattened(flat, seg.metadata) for _ in range(ranks)]
            fmt: str | None = "flattened_bucket"
            keep: Any = flat
        else:
            named = [(n, t if t.device == dev else t.to(dev)) for n, t in seg.named]
            data = [serialize_plain(named) for _ in range(ranks)]
            fmt, keep = None, named
        body = {"serialized_named_tensors": data[0] if ranks == 1 else data,
                "load_format": fmt, "finished": finished}
        body["_keep"] = keep          # popped before sending: holds the tensors until the reply
        return body

    def load_payload(self, payload: Payload) -> None:
        """Send one bucket as LMDeploy /update_weights calls; finished=true only on the last call
        of the last bucket. Calls are made in order (TurboMind consumes layers as a stream)."""
        if self._version is None:
            raise WeightSyncError("load_payload before begin(): no update round is open")
        with self._lock:
            segments = self._segments(payload)
            for i, seg in enumerate(segments):
                finished = payload.last and i == len(segments) - 1
                body = self._body(seg, finished)
                keep = body.pop("_keep")
                self._weights_whole = False          # from here on the engine may hold a mix
                self._request("POST", "/update_weights", body, timeout=self.options.payload_timeout)
                del keep
                if finished:
                    self._finished = True
            if payload.last and not segments:
                raise WeightSyncError("the last bucket produced no call; finished=true was not sent")
            self._acked.ack(payload.index, payload.digest)

    # -- collective --------------------------------------------------------------------------
    def group_size(self) -> int:
        return self.options.tp_size

    def deliver(self, message: Message) -> Mapping[str, Any]:
        """The collective transport's messages on LMDeploy's own routes; returns LMDeploy's
        answer. JoinGroup blocks until every TP rank joined; LeaveGroup destroys the group it
        names (nothing without one); Broadcast is one broadcast (`_announce`)."""
        def timeout(default: float) -> float:
            return default if message.wait is None else message.wait
        if isinstance(message, JoinGroup):
            info = message.body
            body = {k: info[k] for k in ("master_address", "master_port", "rank_offset",
                                         "world_size", "group_name", "backend")}
            if not body["group_name"]:
                raise WeightSyncError("LMDeploy requires a non-empty group_name")
            return self._checked("/init_weights_update_group", body,
                                 timeout(self.options.payload_timeout))
        if isinstance(message, LeaveGroup):
            if not message.body.get("group_name"):
                return {}
            return self._checked("/destroy_weights_update_group",
                                 {"group_name": message.body["group_name"]},
                                 timeout(self.options.timeout))
        if isinstance(message, Broadcast):
            return self._announce(message.body, timeout(self.options.payload_timeout))
        return super().deliver(message)

    def _announce(self, header: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """One broadcast = one /update_weights_from_distributed call (flattened_bucket: a buffer
        of the run's dtype, element counts). finished=true on the last run of the last bucket."""
        tr = header.get("transport") or {}
        if tr.get("layout") != "flat_per_dtype":
            raise WeightSyncError(f"LMDeploy reads broadcasts in layout 'flat_per_dtype', the "
                                  f"transport announced {tr.get('layout')!r}")
        tensors = list(tr["tensors"])
        if any(t["dtype"] != tr["dtype"] for t in tensors):
            raise WeightSyncError("a flattened_bucket broadcast must hold one dtype")
        numel = sum(_numel(t["shape"]) for t in tensors)
        if numel != int(tr["numel"]):
            raise WeightSyncError(f"announced {tr['numel']} elements but the tensors hold {numel}")
        finished = bool(header["last"]) and _is_last_run(header["tensors"], tr["dtype"])
        body = {"names": [t["name"] for t in tensors], "dtypes": [t["dtype"] for t in tensors],
                "shapes": [list(t["shape"]) for t in tensors], "group_name": tr["group_name"],
                "load_format": "flattened_bucket", "finished": finished}
        self._weights_whole = False
        out = self._checked("/update_weights_from_distributed", body, timeout)
        if finished:
            self._finished = True
        if _is_last_run(header["tensors"], tr["dtype"]):
            self._acked.ack(int(header["index"]), str(header["digest"]))
        return out



def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: str) -> int:
    from weightsync.wire.bucket import dtype_from_name
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def _is_last_run(bucket_tensors: list[Mapping[str, Any]], dtype: str) -> bool:
    """Runs go in wire order (itemsize desc, then dtype name): the last is the smallest itemsize
    with the greatest name."""
    dtypes = {t["dtype"] for t in bucket_tensors}
    return dtype == sorted(dtypes, key=lambda d: (-_itemsize(d), d))[-1]
