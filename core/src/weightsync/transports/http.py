"""Transport `http`: payload bytes POSTed to an endpoint the adapter names, one frame per bucket,
to every engine in parallel. For cross-cluster syncs and small deltas, where no shared disk or
group exists."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import requests
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import EngineUnavailable, PayloadError
from ..httpclient import Parts, call
from ..interfaces import Adapter, Payload, Transport, TransportReceiver
from ..wire import frame


class HttpOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(300.0, gt=0, description="seconds per payload request")
    retries: int = Field(1, ge=0, description="extra tries on a dropped connection")


class HttpReceiver(TransportReceiver):
    """The body came in the request itself."""

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        if body is None:
            raise ValueError("http transport: the payload body is missing from the request")
        if len(body) != int(header["nbytes"]):
            raise PayloadError(f"bucket {header['index']}: {len(body)} body bytes arrived, "
                               f"{header['nbytes']} were sent; the request was truncated")
        return torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)


class HttpTransport(Transport):
    name = "http"
    Options = HttpOptions
    requires = "http"
    receiver = HttpReceiver

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._sessions: dict[str, requests.Session] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _session(self, engine: str) -> requests.Session:
        if engine not in self._sessions:
            self._sessions[engine] = requests.Session()
        return self._sessions[engine]

    def _post(self, adapter: Adapter, payload: Payload) -> None:
        ep = adapter.payload_endpoint()
        if ep.render is not None:
            parts, ctype = ep.render(payload.header(), payload.body)
        else:
            parts, ctype = frame(payload.header(), payload.body), "application/octet-stream"
        for attempt in range(self.options.retries + 1):
            try:
                call(self._session(adapter.engine_name), adapter.engine_name, "POST", ep.url,
                     timeout=min(ep.timeout, self.options.timeout), data=Parts(parts),
                     headers={**ep.headers, "Content-Type": ctype})
                return
            except Exception as e:
                if not isinstance(e, EngineUnavailable) or attempt == self.options.retries:
                    raise

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        if payload.body.device.type != "cpu":
            payload.body = payload.body.cpu()
        if len(engines) == 1:
            try:
                self._post(engines[0], payload)
                return {}
            except Exception as e:
                return {engines[0].engine_name: e}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ws-http")
        futures = {a.engine_name: self._pool.submit(self._post, a, payload) for a in engines}
        failures: dict[str, BaseException] = {}
        for name, f in futures.items():
            err = f.exception()
            if err is not None:
                failures[name] = err
        return failures

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
