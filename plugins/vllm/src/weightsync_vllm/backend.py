"""vLLM weight-transfer backend `weightsync` (runs inside every vLLM worker).

A server started with `--weight-transfer-config '{"backend": "weightsync"}'` receives through any
weightsync transport and decodes any weightsync encoding, over vLLM's own four-phase API:

  /init_weight_transfer_engine {"init_info": {"plan": {...}, "version": v, "engine_version": u}}
      picks the transport and encoding of the next round (also: "join"/"leave" a collective
      group, "load_from_disk" a checkpoint directory)
  /start_weight_update                          opens a round (nothing touches the model)
  /update_weights {"update_info": {"header": {...}, "body_b64": "..."}}   one payload; the body
      inline (http) or placed out of band by the transport (shm, collective): then no body_b64
  /collective_rpc {"method": "weightsync_state"} -> the digests of what was staged
  /finish_weight_update {"weight_version": "v"} loads the whole round in one layerwise reload

Every bucket is checked (name and shape against the served checkpoint, dtype, digest) when it
arrives; the model is only touched at finish, so a bad round leaves the previous version serving.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weightsync.errors import PayloadError
from weightsync.receiver import read_checkpoint

from .staging import CheckpointIndex, Round, build_encoding, build_receiver

log = logging.getLogger("weightsync.vllm")


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    plan: dict[str, Any] | None = None          # {"transport": ref, "encoding": ref}
    version: int | None = None                  # the version the next round carries
    engine_version: int | None = None           # the version the engine holds now (delta base)
    join: dict[str, Any] | None = None          # collective: SGLang's init body
    leave: dict[str, Any] | None = None
    load_from_disk: dict[str, Any] | None = None  # {"path": dir}: reload a whole checkpoint


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    header: dict[str, Any] | None = None        # a payload header (weightsync's Payload.header())
    body_b64: str | None = None                 # the body inline (http transport)
    abort: bool = False                         # drop the round; finish then loads nothing


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
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
        self.round: Round | None = None
        self.committed: int | None = None
        log.info("weightsync backend ready: %d checkpoint tensors from %s",
                 len(self.index.specs), self.model_config.model)

    # -- init: plan, group membership, disk reloads -------------------------------------------
    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
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
            self.rx.join(info)
        if init_info.leave is not None:
            self._leave(init_info.leave)
        if init_info.load_from_disk is not None:
            self._load_from_disk(str(init_info.load_from_disk["path"]))

    def _configure(self, plan: dict[str, Any]) -> None:
        tr_key = json.dumps(plan["transport"], sort_keys=True)
        enc_key = json.dumps(plan["encoding"], sort_keys=True)
        old = self.plan_keys or ("", "")
        if tr_key != old[0]:
            rx = build_receiver(plan["transport"], self.components)
            if self.rx is not None:
                self.rx.close()
            self.rx = rx
        if enc_key != old[1]:
            self.encoding = build_encoding(plan["encoding"], self.components)
        self.plan_keys = (tr_key, enc_key)

    def _leave(self, info: dict[str, Any]) -> None:
        """Leave the trainer's group (best effort, like the reference engine's receivers)."""
        if self.rx is not None and hasattr(self.rx, "leave"):
            self.rx.leave(info)
            return
        from weightsync.transports import collective
        forget = getattr(collective, "_forget_groups", None)
        if forget is not None:
            try:
                forget()
            except TypeError:
                forget(keep=None)

    def _load_from_disk(self, path: str) -> None:
        if self.round is not None:
            raise PayloadError("an update round is open; finish or abort it before reloading from disk")
        named = read_checkpoint(path, self.index.check)     # every name and shape checked first
        self._load(named)
        self.index.live.update(named)                 # the delta base is now that checkpoint
        self.committed = self.next_version

    # -- the round --------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        if self.encoding is None or self.rx is None:
            raise PayloadError("no weightsync plan: POST /init_weight_transfer_engine with "
                               "init_info.plan (the weightsync 'vllm' adapter does this) first")
        self.round = Round(self.index, self.encoding, self.rx, self.next_version)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        r = self.round
        if r is None:
            raise PayloadError("no weightsync round is open; call /start_weight_update first")
        if update_info.abort:
            r.aborted = True
            r.staged.clear()
            return
        if update_info.header is None:
            raise PayloadError("update_info needs a payload 'header' (or 'abort': true)")
        body = None
        if update_info.body_b64 is not None:
            body = memoryview(base64.b64decode(update_info.body_b64, validate=True))
        try:
            r.stage(update_info.header, body)
        except BaseException:
            self.round = None       # vLLM ends the session on an error; so does the round
            raise

    def digests(self) -> dict[int, str]:
        if self.round is None:
            raise PayloadError("no weightsync round is open (it failed or was never started)")
        return self.round.end()

    def finish_weight_update(self) -> None:
        r, self.round = self.round, None
        if r is None or r.aborted:
            return
        r.end()
        self._load(r.staged)
        self.index.live.update(r.staged)
        self.committed = r.version
        if r.version is not None:
            r.encoding.commit(r.version)
        log.info("weightsync: loaded %d tensors (version %s)", len(r.staged), r.version)

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
                self.model.load_weights(iter(list(named.items())))
            finally:
                finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.round = None
        if self.rx is not None:
            self.rx.close()
            self.rx = None
        self.plan_keys = None


def _weightsync_state(self: Any) -> dict[str, Any]:
    """Worker RPC (POST /collective_rpc {"method": "weightsync_state"}): the digests of the open
    round, computed here in the worker from what was staged."""
    engine = getattr(getattr(self, "worker", self), "weight_transfer_engine", None)
    if not isinstance(engine, WeightSyncTransferEngine):
        raise RuntimeError("this vLLM server does not run the weightsync backend; start it with "  # noqa: TRY004
                           "--weight-transfer-config '{\"backend\": \"weightsync\"}'")
    return {"digests": {str(k): v for k, v in engine.digests().items()},
            "committed": engine.committed, "rank": int(engine.parallel_config.rank)}


def _install_rpc() -> None:
    """Make `weightsync_state` callable through collective_rpc without a worker extension."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase
    if not hasattr(WorkerWrapperBase, "weightsync_state"):
        WorkerWrapperBase.weightsync_state = _weightsync_state


_install_rpc()
