"""Adapter `sglang`: drives an SGLang 0.5.23 server through its own weight-update routes
(docs/engines.md, SGLang). Nothing of SGLang is imported.

Routes: pause `/pause_generation` (abort | retract | in_place), resume `/continue_generation`,
health `/health` + `GET /model_info` (weight_version), commit `/flush_cache` +
`/update_weight_version`, disk `/update_weights_from_disk`, colocated `/update_weights_from_tensor`
(transport `sglang_tensor`), disaggregated `/init_weights_update_group` +
`/update_weights_from_distributed` + `/destroy_weights_update_group` (core transport `collective`,
whose `JoinGroup`, `Broadcast` and `LeaveGroup` messages `deliver` translates into those routes:
SGLang does not run weightsync's receiver). Rollouts are `generation.SGLangSampler`.

SGLang stages nothing: it loads every bucket as it arrives, so it is paused before the first
payload (`staging = False`). It cannot hash what it loaded, so `end()` returns the sender's digest
of exactly the buckets SGLang acknowledged with `success: true` (a bucket it refused or never
answered is missing, and the pipeline then fails the engine): the outcome is `acknowledged`.
With `readback` on (the default) the adapter also samples a few tensors it sent and, after
commit, reads them back through `/get_weights_by_name`: equal values make the outcome `verified`
(by sample), different ones fail the engine. A failed round leaves SGLang partially updated (its
own words: "Please discard the whole weights"); the weight version is not advanced, so the next
push resends everything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import requests
from pydantic import BaseModel, ConfigDict, Field
from weightsync.errors import ConfigError, EngineError
from weightsync.net.client import error_text
from weightsync.interfaces import AckedRound, EngineStatus, HttpAdapter, Message
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup

from .readback import ReadbackPicks, depth, same
from .versions import from_sglang, to_sglang

log = logging.getLogger(__name__)
# SGLang's own modes under names that say what they do with a running request's KV: "keep" and
# "retract" send it back to the queue (its KV recomputed with the new weights), "abort" ends it,
# "in_place_stale_kv" (SGLang's in_place) goes on over the old weights' KV: only when asked for
PauseMode = Literal["abort", "retract", "keep", "in_place_stale_kv"]
SGLANG_MODE = {"keep": "retract", "in_place_stale_kv": "in_place"}


class SGLangOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size of the server: its ranks in a "
                                              "collective group and its entries per tensor update")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls (health, pause, commit)")
    update_timeout: float = Field(600.0, gt=0, description="seconds for one weight update call "
                                                           "(one bucket, a disk reload, a group join)")
    pause_mode: PauseMode | None = Field(None, description="this engine's pause mode; overrides "
                                                           "sync.pause_mode")
    flush_cache: bool = Field(True, description="flush the radix cache when a version is committed")
    abort_all_requests: bool = Field(False, description="disk reloads: abort running requests first")
    load_format: str | None = Field(None, description="disk reloads: SGLang load_format (null: the "
                                                      "server's own)")
    health_route: Literal["/health", "/health_generate"] = "/health"
    version_prefix: str = Field("", description="weight_version is f'{prefix}{version}'")
    readback: bool = Field(True, description="after commit, read sampled tensors back through "
                                             "/get_weights_by_name and compare them with what was "
                                             "sent (outcome `verified` instead of `acknowledged`)")
    readback_tensors: int = Field(4, ge=1, le=64, description="tensors sampled per sync for read-back")
    readback_rows: int = Field(2, ge=1, le=100, description="rows (dim 0) read back per sampled tensor")


class SGLangAdapter(HttpAdapter):
    name = "sglang"
    Options = SGLangOptions
    accepts = (Broadcast, JoinGroup, LeaveGroup)  # collective's messages, on SGLang's own routes
    encodings = frozenset({"raw", "cast"})   # SGLang loads the tensors it is given, as they are
    pause_modes = ("abort", "retract", "keep", "in_place_stale_kv")
    layout = "flat"                          # flattened_bucket: the payload's data section
    staging = False                          # SGLang loads each bucket as it arrives: pause first
    verification = "ack"                     # it cannot hash what it loaded; confirm() reads back

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self._acked = AckedRound()
        self._mode: str | None = None
        self._picks = ReadbackPicks(self.options.readback_tensors, self.options.readback_rows)

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                 params: Mapping[str, Any] | None = None) -> requests.Response:
        return self.request(method, path, timeout=timeout, ok=(200, 400), json=body, params=params)

    def _post(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST a weight route; SGLang answers {"success", "message"} (200 or 400). A refusal is
        raised with SGLang's own message."""
        resp = self._request("POST", path, dict(body), timeout)
        try:
            out = resp.json()
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise EngineError(self.engine_name, f"POST {path} -> HTTP {resp.status_code}: "
                                                f"{error_text(resp)}")
        if resp.status_code != 200 or out.get("success") is False:
            raise EngineError(self.engine_name, f"SGLang refused POST {path}: "
                                                f"{out.get('message') or error_text(resp)}")
        return out

    # -- control --------------------------------------------------------------------------------
    def health(self) -> EngineStatus:
        resp = self._request("GET", self.options.health_route)
        if resp.status_code != 200:
            raise EngineError(self.engine_name, f"{self.options.health_route} -> HTTP "
                                                f"{resp.status_code}: {error_text(resp)}")
        version, info = self.model_info()
        return EngineStatus(version, self._mode is not None, info)

    def model_info(self) -> tuple[int, dict[str, Any]]:
        """GET /model_info: (weightsync version of its weight_version, the whole answer)."""
        resp = self._request("GET", "/model_info")
        try:
            info = resp.json() if resp.status_code == 200 else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise EngineError(self.engine_name, f"GET /model_info -> HTTP {resp.status_code}: "
                                                f"{error_text(resp)}")
        return self.version_of(info.get("weight_version")), info

    def version_of(self, raw: Any) -> int:
        """The weightsync version of an SGLang weight_version string; anything else is an error."""
        try:
            return from_sglang(raw, self.options.version_prefix)
        except ValueError as e:
            raise EngineError(self.engine_name, str(e)) from None

    def pause(self, mode: str) -> None:
        mode = self.options.pause_mode or mode
        if mode not in self.pause_modes:
            hint = ("; SGLang's in_place keeps the old weights' KV: ask for it as "
                    "'in_place_stale_kv'" if mode == "in_place" else "")
            raise ConfigError(f"adapter 'sglang' pauses with {list(self.pause_modes)}, not "
                              f"{mode!r}{hint}")
        resp = self._request("POST", "/pause_generation", self.pause_body(mode))
        if resp.status_code != 200:
            raise EngineError(self.engine_name, f"POST /pause_generation -> HTTP "
                                                f"{resp.status_code}: {error_text(resp)}")
        self._mode = mode

    def pause_body(self, mode: str) -> dict[str, Any]:
        """PauseGenerationReqInput."""
        return {"mode": SGLANG_MODE.get(mode, mode)}

    def resume(self) -> None:
        resp = self._request("POST", "/continue_generation", {})
        if resp.status_code != 200:
            raise EngineError(self.engine_name, f"POST /continue_generation -> HTTP "
                                                f"{resp.status_code}: {error_text(resp)}")
        self._mode = None

    # -- one update round -----------------------------------------------------------------------
    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        self._acked.reset()
        self._picks.reset(seed=version)

    def observe(self, payload: Any) -> None:
        if self.options.readback:
            self._picks.observe(payload)

    def confirm(self, version: int) -> bool:
        """Read the sampled tensors back (SGLang's `/get_weights_by_name`, first rows as float32
        lists). True when at least one was read and all equal what was sent; a name SGLang cannot
        read back (its route answers 400) is skipped; a difference raises."""
        if not self.options.readback:
            return False
        checked = 0
        for name, want in self._picks.samples.items():
            resp = self._request("POST", "/get_weights_by_name",
                                 {"name": name, "truncate_size": self.options.readback_rows})
            if resp.status_code != 200:
                log.info("engine %s: /get_weights_by_name %s -> HTTP %d: %s", self.engine_name,
                         name, resp.status_code, error_text(resp))
                continue
            got = resp.json()
            ranks = got if depth(got) == depth(want) + 1 else [got]   # data parallel: per rank
            for g in ranks:
                if not same(want, g):
                    raise EngineError(self.engine_name, f"tensor {name!r} read back through "
                                      f"/get_weights_by_name differs from what was sent")
            checked += 1
        return checked > 0

    def _ack(self, header: Mapping[str, Any]) -> None:
        self._acked.ack(int(header["index"]), str(header["digest"]))

    def end(self) -> dict[int, str]:
        """The sender's digests of the buckets SGLang acknowledged (it cannot re-hash them)."""
        return self._acked.digests()

    def commit(self, version: int) -> None:
        """Flush the radix cache (cached prefixes hold the old weights' KV) in every pause mode;
        SGLang refuses while requests run in place, which only `in_place_stale_kv` asks for."""
        if self.options.flush_cache:
            try:
                self.flush_cache()
            except EngineError as e:
                if self._mode != "in_place_stale_kv":
                    raise
                log.warning("engine %s: %s; requests held in place go on over the old weights' "
                            "KV, as in_place_stale_kv asks", self.engine_name, e.detail)
        self.set_weight_version(version)

    def abort(self) -> None:
        """SGLang cannot drop what it already loaded; the version stays where it was."""
        n = self._acked.reset()
        if n:
            log.warning("engine %s: SGLang loaded %d bucket(s) of an aborted sync; its weights are "
                        "partially updated until the next push completes", self.engine_name, n)

    def flush_cache(self) -> None:
        resp = self._request("POST", "/flush_cache")
        if resp.status_code != 200:
            raise EngineError(self.engine_name, f"SGLang refused POST /flush_cache: {resp.text.strip()}")

    def version_body(self, version: int) -> dict[str, Any]:
        """UpdateWeightVersionReqInput; requests keep running (we paused them ourselves)."""
        return {"new_version": to_sglang(version, self.options.version_prefix),
                "abort_all_requests": False}

    def set_weight_version(self, version: int) -> None:
        self._post("/update_weight_version", self.version_body(version))

    # -- routes that load weights ---------------------------------------------------------------
    def _update_flags(self) -> dict[str, Any]:
        # flushing once at commit is enough; the version is set at commit, after verification
        return {"flush_cache": False, "abort_all_requests": False, "weight_version": None}

    def distributed_body(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """UpdateWeightsFromDistributedReqInput for one broadcast, from the transport's fields."""
        tr = header.get("transport") or {}
        if tr.get("layout") != "flat":
            raise EngineError(self.engine_name, f"SGLang takes flattened_bucket broadcasts (layout "
                                                f"'flat'), got layout {tr.get('layout')!r}")
        tensors = tr["tensors"]
        return {"names": [t["name"] for t in tensors], "dtypes": [t["dtype"] for t in tensors],
                "shapes": [list(t["shape"]) for t in tensors], "group_name": tr["group_name"],
                "load_format": "flattened_bucket", **self._update_flags()}

    def tensor_body(self, serialized: list[str]) -> dict[str, Any]:
        """UpdateWeightsFromTensorReqInput: one serialized flattened bucket per TP rank."""
        if len(serialized) != self.options.tp_size:
            raise ValueError(f"{len(serialized)} serialized entries for tp_size {self.options.tp_size}")
        return {"serialized_named_tensors": serialized, "load_format": "flattened_bucket",
                **self._update_flags()}

    def update_from_tensor(self, serialized: list[str], header: Mapping[str, Any]) -> None:
        """Colocated (transport `sglang_tensor`): SGLang maps the shared tensors and loads them."""
        self._post("/update_weights_from_tensor", self.tensor_body(serialized),
                   timeout=self.options.update_timeout)
        self._ack(header)

    def disk_body(self, path: str, version: int) -> dict[str, Any]:
        """UpdateWeightFromDiskReqInput for a host-local checkpoint directory."""
        return {"model_path": str(path), "load_format": self.options.load_format,
                "flush_cache": self.options.flush_cache,
                "abort_all_requests": self.options.abort_all_requests,
                "weight_version": to_sglang(version, self.options.version_prefix)}

    def load_from_disk(self, path: str, version: int, allow_older: bool = False) -> None:
        """ReloadsFromDisk: SGLang reloads every weight from `path` and takes `version` (it
        reloads the previous path itself if loading fails). SGLang keeps no version order, so
        it loads an older version too (`allow_older` changes nothing); it checks no signature."""
        self._post("/update_weights_from_disk", self.disk_body(path, version),
                   timeout=self.options.update_timeout)

    # -- collective group (transport `collective`) -------------------------------------------------
    def group_size(self) -> int:
        """JoinsGroups: every TP rank joins the group."""
        return self.options.tp_size

    def join_body(self, info: Mapping[str, Any]) -> dict[str, Any]:
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        return {k: info[k] for k in keys}

    def leave_body(self, info: Mapping[str, Any]) -> dict[str, Any]:
        """DestroyWeightsUpdateGroupReqInput."""
        return {"group_name": info["group_name"]}

    def deliver(self, message: Message) -> Mapping[str, Any]:
        """The collective transport's messages on SGLang's own routes; returns SGLang's answer.
        JoinGroup blocks while every TP rank joins at rank_offset + tp_rank; Broadcast blocks
        while the trainer broadcasts that bucket to the group, and SGLang's `success: true`
        acknowledges it (`end`); LeaveGroup destroys the group it names (nothing without one)."""
        def timeout(default: float | None) -> float | None:
            return default if message.wait is None else message.wait
        if isinstance(message, JoinGroup):
            return self._post("/init_weights_update_group", self.join_body(message.body),
                              timeout=timeout(self.options.update_timeout))
        if isinstance(message, LeaveGroup):
            if not message.body.get("group_name"):
                return {}
            return self._post("/destroy_weights_update_group", self.leave_body(message.body),
                              timeout=timeout(None))
        if isinstance(message, Broadcast):
            out = self._post("/update_weights_from_distributed", self.distributed_body(message.body),
                             timeout=timeout(self.options.update_timeout))
            self._ack(message.body)
            return out
        return super().deliver(message)

