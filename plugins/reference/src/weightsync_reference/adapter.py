"""Adapter `reference`: drives weightsync's reference engine (`weightsync serve`), and any engine
that mounts the same routes around weightsync's receiver. The engine stages whole rounds (paused
only for the swap), hashes what it staged (verified), and holds rounds and pauses under leases
with round ids (`X-Weightsync-Round`). Every transport message goes to `/weightsync/deliver`,
where the engine's receiver hands it to the round's transport receiving half (`accepts = None`).
Rollouts are `weightsync_reference.sampler`, launching `weightsync_reference.launcher`."""

from __future__ import annotations

import re
import time
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import EngineError
from weightsync.interfaces import Endpoint, EngineStatus, HttpAdapter, Message
from weightsync.interfaces.sampling import Unsupported
from weightsync_reference.server.sampler import PAUSE_MODES
from weightsync.net.client import json_of

ROUND_HEADER = "X-Weightsync-Round"
_OPEN_ROUND = re.compile(r"is open; this begin .* lease expires in ([0-9.]+)s")
_OPEN_ROUND_POLL = 0.25      # seconds between begins while another trainer's round is open


class ReferenceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls")
    payload_timeout: float = Field(300.0, gt=0, description="seconds for one payload or join")
    generate_timeout: float = Field(600.0, gt=0, description="seconds for one generation request "
                                                            "(beyond the gate's wait)")


class ReferenceAdapter(HttpAdapter):
    name = "reference"
    Options = ReferenceOptions
    accepts = None                       # the engine's receiver parses every transport's messages
    encodings = None
    pause_modes = PAUSE_MODES           # "keep" prefills again after a swap; "keep_stale_kv" not
    ordered_announces = True
    staging = True
    verification = "digest"
    leases = True

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self.round_id: str | None = None

    def _round(self) -> dict[str, str]:
        return {ROUND_HEADER: self.round_id} if self.round_id else {}

    def _post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        resp = self.request("POST", path, timeout=timeout, headers=self._round(),
                            json=body if body is not None else {})
        return json_of(resp, self.engine_name)

    def health(self) -> EngineStatus:
        body = json_of(self.request("GET", "/health"), self.engine_name) or {}
        return EngineStatus(int(body.get("version", 0)), bool(body.get("paused")), body)

    def check_access(self) -> None:
        """`GET /info` takes the engine key (a 401 or 403 names what was refused)."""
        self.request("GET", "/info", push=False)

    def pause(self, mode: str) -> None:
        self._post("/pause", {"mode": mode, "lease": self.lease})

    def resume(self) -> None:
        self._post("/resume")

    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        """Open a round. A round left open by a trainer that died (its lease still running)
        is waited out, within the push's deadline, instead of failing the push: a restarted
        trainer takes over once the old lease lapses. The wait is polled (at most
        `_OPEN_ROUND_POLL` s a try), so a round that ends early lets this one in at once
        rather than after its whole lease."""
        self.round_id = None
        while True:
            try:
                body = self._post("/weightsync/begin",
                                  {**plan, "version": version, "lease": self.lease}) or {}
                break
            except EngineError as e:
                m = _OPEN_ROUND.search(e.detail)
                if m is None or self.deadline is None:
                    raise
                left = self.deadline - time.monotonic() - 1.0
                if min(float(m.group(1)) + 0.1, left) <= 0:
                    raise
                # the engine said when the old lease ends; the round may end sooner
                time.sleep(min(float(m.group(1)) + 0.1, left, _OPEN_ROUND_POLL))
        self.round_id = body.get("round")

    def round_state(self) -> dict[str, Any]:
        return {"round": self.round_id}

    def join_round(self, state: Mapping[str, Any]) -> None:
        """Another trainer rank's round: its payloads carry that round's id."""
        self.round_id = state.get("round")

    def renew(self) -> None:
        self._post("/weightsync/renew", {"lease": self.lease}, timeout=max(0.5, self.lease / 3))

    def end(self) -> dict[int, str]:
        body = self._post("/weightsync/end", timeout=self.options.payload_timeout) or {}
        try:
            return {int(k): str(v) for k, v in body["digests"].items()}
        except (KeyError, AttributeError, ValueError):
            raise EngineError(self.engine_name, f"/weightsync/end answered without digests: {body}") from None

    def commit(self, version: int) -> None:
        self._post("/weightsync/commit", {"version": version}, timeout=self.options.payload_timeout)
        self.round_id = None

    def abort(self) -> None:
        if self.round_id is None:            # no round of ours is open there
            return
        try:
            self._post("/weightsync/abort")
        finally:
            self.round_id = None

    def payload_endpoint(self) -> Endpoint:
        return Endpoint(self.base + "/weightsync/payload", {**self.headers, **self._round()},
                        self.bounded(self.options.payload_timeout))

    def relay_target(self) -> Endpoint | None:
        return Endpoint(self.base + "/weightsync/relay", self._round(),
                        self.bounded(self.options.payload_timeout))

    def deliver(self, message: Message) -> Mapping[str, Any]:
        """Any transport's message, in the open round: the engine hands it to the round's
        transport receiving half (or its own relay desk, for http's relay messages)."""
        wait = message.wait if message.wait is not None else self.options.payload_timeout
        got = self._post("/weightsync/deliver", message.wire(), timeout=wait)
        return got if isinstance(got, Mapping) else {}

    def group_size(self) -> int:
        """One rank: the reference engine runs in one process."""
        return 1

    def load_from_disk(self, path: str, version: int, allow_older: bool = False,
                       signature: Mapping[str, Any] | None = None) -> None:
        """`allow_older`: an operator's rollback (the engine refuses to move back otherwise);
        `signature`: weightsync.wire.signing.checkpoint_signature, for an engine with an HMAC key."""
        body: dict[str, Any] = {"path": str(path), "version": int(version),
                                "allow_older": bool(allow_older)}
        if signature is not None:
            body["signature"] = dict(signature)
        self._post("/weightsync/load_from_disk", body, timeout=self.options.payload_timeout)

    def share(self, token: str, ttl: float) -> dict[str, Any]:
        return self._post("/weightsync/peer/share", {"token": token, "ttl": ttl}) or {}

    def pull(self, peer: Mapping[str, Any]) -> int:
        body = self._post("/weightsync/pull", {"peer": dict(peer)},
                          timeout=self.options.payload_timeout) or {}
        return int(body.get("version", 0))

    # -- the probe ---------------------------------------------------------------------------
    def score(self, ids: list[int]) -> tuple[list[float], int]:
        resp = self.request("POST", "/score", ok=(200, 409), json={"input_ids": list(ids)})
        out = json_of(resp, self.engine_name) or {}
        if resp.status_code == 409:          # a weights-only engine runs no model
            raise Unsupported(f"{self.engine_name}: {out.get('error', 'cannot score')}")
        return [float(x) for x in out["logprobs"]], int(out["weight_version"])

    def distrust(self, version: int, reason: str) -> bool:
        self._post("/weightsync/distrust", {"version": version, "reason": reason})
        return True
