"""Adapter `reference`: drives weightsync's reference engine (`weightsync serve`), and any engine
that mounts the same routes around weightsync's receiver. The engine stages whole rounds (paused
only for the swap), hashes what it staged (verified), and holds rounds and pauses under leases
with round ids (`X-Weightsync-Round`)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import EngineError, WeightSyncError
from weightsync.net.client import auth_headers, call, json_of, session_for
from weightsync.interfaces import Adapter, Endpoint, EngineStatus, LocalEngine
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams, Unsupported

ROUND_HEADER = "X-Weightsync-Round"
_OPEN_ROUND = re.compile(r"is open; this begin .* lease expires in ([0-9.]+)s")
_OPEN_ROUND_POLL = 0.25      # seconds between begins while another trainer's round is open


class ReferenceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, gt=0, description="seconds for control calls")
    payload_timeout: float = Field(300.0, gt=0, description="seconds for one payload or join")
    generate_timeout: float = Field(600.0, gt=0, description="seconds for one generation request "
                                                            "(beyond the gate's wait)")


class ReferenceAdapter(Adapter):
    name = "reference"
    Options = ReferenceOptions
    capabilities = frozenset({"http", "announce", "group", "disk", "peer", "pull"})
    encodings = None
    pause_modes = ("abort", "keep")
    ordered_announces = True
    staging = True
    verification = "digest"
    leases = True

    def __init__(self, options: BaseModel | None = None, engine: Any = None) -> None:
        super().__init__(options, engine)
        self.session = session_for(self.engine)
        self.headers = auth_headers(self.engine.api_key)
        self.base = self.engine.url.rstrip("/")
        self.round_id: str | None = None

    def _headers(self) -> dict[str, str]:
        return {**self.headers, ROUND_HEADER: self.round_id} if self.round_id else dict(self.headers)

    def _post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        resp = call(self.session, self.engine_name, "POST", self.base + path,
                    timeout=self.bounded(timeout or self.options.timeout),
                    json=body if body is not None else {}, headers=self._headers())
        return json_of(resp, self.engine_name)

    def health(self) -> EngineStatus:
        resp = call(self.session, self.engine_name, "GET", self.base + "/health",
                    timeout=self.bounded(self.options.timeout), headers=self.headers)
        body = json_of(resp, self.engine_name) or {}
        return EngineStatus(int(body.get("version", 0)), bool(body.get("paused")), body)

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
        return Endpoint(self.base + "/weightsync/payload", self._headers(),
                        self.bounded(self.options.payload_timeout))

    def relay_target(self) -> Endpoint | None:
        rid = {ROUND_HEADER: self.round_id} if self.round_id else {}
        return Endpoint(self.base + "/weightsync/relay", rid,
                        self.bounded(self.options.payload_timeout))

    def expect(self, body: Mapping[str, Any]) -> None:
        self._post("/weightsync/expect", dict(body))

    def relay_answer(self, index: int, wait: float) -> Mapping[str, Any]:
        got = self._post("/weightsync/relayed", {"index": index, "wait": wait}, timeout=wait + 10)
        return got if isinstance(got, Mapping) else {}

    def announce(self, header: Mapping[str, Any]) -> None:
        self._post("/weightsync/announce", dict(header), timeout=self.options.payload_timeout)

    def join_group(self, info: Mapping[str, Any]) -> None:
        self._post("/weightsync/join", dict(info), timeout=self.options.payload_timeout)

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

    # -- rollouts and the probe --------------------------------------------------------------
    sampling = frozenset(SamplingParams.model_fields)
    scores = True
    gates = True

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        """The engine gates on the server: it waits up to `gate.wait` for a fitting version."""
        body = {"input_ids": prompt, "sampling": params.model_dump(), "wait": gate.wait,
                "min_version": gate.min_version, "exact_version": gate.exact_version}
        resp = call(self.session, self.engine_name, "POST", self.base + "/generate", json=body,
                    headers=self.headers, ok=(200, 409),
                    timeout=gate.wait + self.options.generate_timeout)
        out = json_of(resp, self.engine_name) or {}
        if resp.status_code == 409:
            raise NotFitting(f"{self.engine_name}: {out.get('error', out)}", out.get("weight_version"))
        try:
            return [Sample(token_ids=s["output_ids"], logprobs=s["logprobs"],
                           finish_reason=s["finish_reason"], engine=self.engine_name,
                           version=int(s["weight_version"]), version_end=int(s["weight_version_end"]),
                           prompt_ids=list(prompt)) for s in out["samples"]]
        except (KeyError, TypeError, ValueError):
            raise EngineError(self.engine_name, f"/generate answered without samples: "
                                                f"{str(out)[:200]}") from None

    def weight_version(self) -> int | None:
        """None while the engine's probe failed on what it holds (it serves no gated request)."""
        try:
            st = self.health()
        except WeightSyncError:
            return None
        bad = st.info.get("distrusted")
        return None if bad and bad.get("version") == st.version else st.version

    def score(self, ids: list[int]) -> tuple[list[float], int]:
        resp = call(self.session, self.engine_name, "POST", self.base + "/score", ok=(200, 409),
                    json={"input_ids": list(ids)}, headers=self.headers,
                    timeout=self.bounded(self.options.timeout))
        out = json_of(resp, self.engine_name) or {}
        if resp.status_code == 409:          # a weights-only engine runs no model
            raise Unsupported(f"{self.engine_name}: {out.get('error', 'cannot score')}")
        return [float(x) for x in out["logprobs"]], int(out["weight_version"])

    def busy_seconds(self) -> float | None:
        resp = call(self.session, self.engine_name, "GET", self.base + "/info",
                    timeout=self.options.timeout, headers=self.headers)
        return float((json_of(resp, self.engine_name) or {}).get("busy_seconds", 0.0))

    def distrust(self, version: int, reason: str) -> bool:
        self._post("/weightsync/distrust", {"version": version, "reason": reason})
        return True

    # -- launching ----------------------------------------------------------------------------
    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        argv = ["{python}", "-m", "weightsync", "serve", "--model", model, "--host", host,
                "--port", str(port), "--name", name, "--device", str(extra.get("device", "cpu"))]
        for root in extra.get("load_roots") or []:
            argv += ["--load-root", root]
        if extra.get("api_key"):
            env["WEIGHTSYNC_API_KEY"] = extra["api_key"]
        return argv

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> LocalEngine:
        from weightsync_reference.processes import EngineProcess
        e = EngineProcess(model_dir, name=name, log=Path(workdir) / f"{name}.log",
                          extra_args=extra_args or []).start(timeout=120)
        return LocalEngine(e.spec(), e.stop)

    def close(self) -> None:
        self.session.close()
