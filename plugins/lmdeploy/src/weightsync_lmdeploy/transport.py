"""Transport `lmdeploy_ipc`: LMDeploy's own same-host route, `POST /update_weights`, whose body
carries tensor handles (CUDA IPC; shared-memory names for CPU tensors) rather than bytes. The
handles are only valid on this host and only LMDeploy reads this body, so the transport is
same-host and requires `LoadsLmdeployPayloads`, which only the `lmdeploy` adapter implements: the
config validator refuses it with any other adapter, and for remote engines."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from weightsync.interfaces import Adapter, Payload, Transport


class LmdeployIpcOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parallel: int = Field(8, ge=1, description="engines loaded at the same time")


@runtime_checkable
class LoadsLmdeployPayloads(Protocol):
    """The capability this transport requires: the adapter cuts a payload into LMDeploy
    `/update_weights` calls and posts them (`LmdeployAdapter` implements it)."""

    def load_payload(self, payload: Payload) -> None:
        """Load one bucket; returns once LMDeploy answered its last call."""


class LmdeployIpcTransport(Transport):
    name = "lmdeploy_ipc"
    Options = LmdeployIpcOptions
    requires = (LoadsLmdeployPayloads,)
    same_host = True
    receiver = None          # LMDeploy receives by itself

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._pool: ThreadPoolExecutor | None = None

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """The adapter cuts the payload into its engine's calls (backend, TP size, layout) and
        holds the tensors until LMDeploy answers, so the handles stay valid."""
        if len(engines) == 1:
            try:
                _loader(engines[0]).load_payload(payload)
                return {}
            except Exception as e:  # noqa: BLE001 - reported per engine
                return {engines[0].engine_name: e}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.options.parallel, thread_name_prefix="ws-lmdeploy")
        futures = {a.engine_name: self._pool.submit(lambda a: _loader(a).load_payload(payload), a)
                   for a in engines}
        return {n: err for n, f in futures.items() if (err := f.exception()) is not None}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _loader(a: Adapter) -> LoadsLmdeployPayloads:
    if not isinstance(a, LoadsLmdeployPayloads):   # the config check refuses such an adapter first
        raise TypeError(f"adapter {a.name!r} cannot load LMDeploy payloads "
                        f"(transport 'lmdeploy_ipc' requires LoadsLmdeployPayloads)")
    return a
