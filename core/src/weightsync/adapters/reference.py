"""Adapter `reference`: drives weightsync's reference engine (`weightsync serve`), and any engine
that mounts the same routes around weightsync's receiver."""

from __future__ import annotations

from typing import Any, Mapping

import requests
from pydantic import BaseModel, ConfigDict, Field

from ..errors import EngineError
from ..httpclient import auth_headers, call, json_of
from ..interfaces import Adapter, Endpoint, EngineStatus


class ReferenceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls")
    payload_timeout: float = Field(600.0, gt=0, description="seconds for one payload or join")


class ReferenceAdapter(Adapter):
    name = "reference"
    Options = ReferenceOptions
    capabilities = frozenset({"http", "announce", "group", "disk"})
    encodings = None
    pause_modes = ("abort", "keep")
    ordered_announces = True

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self.session = requests.Session()
        self.headers = auth_headers(self.engine.api_key)
        self.base = self.engine.url.rstrip("/")

    def _post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        resp = call(self.session, self.engine_name, "POST", self.base + path,
                    timeout=timeout or self.options.timeout, json=body if body is not None else {},
                    headers=self.headers)
        return json_of(resp, self.engine_name)

    def health(self) -> EngineStatus:
        resp = call(self.session, self.engine_name, "GET", self.base + "/health",
                    timeout=self.options.timeout, headers=self.headers)
        body = json_of(resp, self.engine_name) or {}
        return EngineStatus(int(body.get("version", 0)), bool(body.get("paused")), body)

    def pause(self, mode: str) -> None:
        self._post("/pause", {"mode": mode})

    def resume(self) -> None:
        self._post("/resume")

    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        self._post("/weightsync/begin", {**plan, "version": version})

    def end(self) -> dict[int, str]:
        body = self._post("/weightsync/end", timeout=self.options.payload_timeout) or {}
        try:
            return {int(k): str(v) for k, v in body["digests"].items()}
        except (KeyError, AttributeError, ValueError):
            raise EngineError(self.engine_name, f"/weightsync/end answered without digests: {body}") from None

    def commit(self, version: int) -> None:
        self._post("/weightsync/commit", {"version": version}, timeout=self.options.payload_timeout)

    def abort(self) -> None:
        self._post("/weightsync/abort")

    def payload_endpoint(self) -> Endpoint:
        return Endpoint(self.base + "/weightsync/payload", dict(self.headers), self.options.payload_timeout)

    def announce(self, header: Mapping[str, Any]) -> None:
        self._post("/weightsync/announce", dict(header), timeout=self.options.payload_timeout)

    def join_group(self, info: Mapping[str, Any]) -> None:
        self._post("/weightsync/join", dict(info), timeout=self.options.payload_timeout)

    def load_from_disk(self, path: str, version: int) -> None:
        self._post("/weightsync/load_from_disk", {"path": str(path), "version": int(version)},
                   timeout=self.options.payload_timeout)

    def close(self) -> None:
        self.session.close()
