"""The reference engine's generation side: sampling requests go to the batched sampler behind
a version gate, the probe's scoring, and the distrust a failed probe leaves. Mixed into
ReferenceEngine, whose state (version, pause, model lock) it reads."""

from __future__ import annotations

import time
from typing import Any, Callable

from weightsync.errors import PayloadError
from weightsync.net.server import Conflict409
from weightsync.interfaces.sampling import SamplingParams
from weightsync_reference.server.sampler import Aborted, make_rows, score


class Conflict(Conflict409):
    """The request does not fit the engine's current state (HTTP 409)."""


class HungUp(Exception):
    """The caller closed its connection: the request's rows stop, nothing is answered."""


class VersionGate(Conflict):
    """A generation asked for a version this engine does not hold (HTTP 409 with the version)."""

    def __init__(self, message: str, held: int) -> None:
        super().__init__(message)
        self.held = held


class Generation:
    """Generation for an engine with `model`, `version`, `state` (a Condition), `paused`,
    `pause_epoch`, `model_lock`, `sampler` and `distrusted`."""

    model: Any
    version: int
    state: Any
    paused: str | None
    pause_epoch: int
    pause_at: tuple[str, int] | None
    last_pause: str | None
    model_lock: Any
    sampler: Any
    distrusted: dict[str, Any] | None

    # -- generation -------------------------------------------------------------------------
    def generate(self, ids: list[int], params: SamplingParams, *, min_version: int | None = None,
                 exact_version: int | None = None, wait: float = 0.0,
                 timeout: float = 600.0, gone: Callable[[], bool] | None = None
                 ) -> list[dict[str, Any]]:
        """`params.n` samples of `ids` with the logprob of every token, batched with whatever
        else is waiting. With `min_version` / `exact_version` it first waits up to `wait` seconds
        for a fitting version, else answers 409 with the version it holds; an exact request whose
        weights change while it runs is answered 409 as well, never with tokens of two versions.
        Other samples that span a commit carry both versions. `gone` says the caller hung up:
        the request's rows then stop at the next token (a router cancelled it, or moved it away
        from this engine), so the batch's other requests go on without them."""
        if self.model.module is None:
            raise Conflict("this is a weights-only engine (no config.json); it cannot generate")
        if not ids:
            raise PayloadError("input_ids must not be empty")
        vocab = self.vocab_size()
        bad = [t for t in ids + params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise PayloadError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        self._gate(min_version, exact_version, wait)

        seen = [time.monotonic()]

        def check(version: int) -> None:
            if gone is not None and time.monotonic() - seen[0] >= 0.05:
                seen[0] = time.monotonic()
                if gone():
                    raise HungUp("the caller hung up")
            if exact_version is not None and version != exact_version:
                raise VersionGate(f"the weights changed from version {exact_version} to "
                                  f"{version} during generation; retry", version)
        rows = self.sampler.run(make_rows(ids, params), check, timeout)
        return [r.as_dict() for r in rows]

    def vocab_size(self) -> int:
        assert self.model.module is not None
        return int(self.model.module.get_output_embeddings().weight.shape[0])

    def score(self, ids: list[int]) -> dict[str, Any]:
        """The probe: the logprob of each token of `ids` after the first, and the version."""
        if self.model.module is None:
            raise Conflict("this is a weights-only engine (no config.json); it cannot score")
        vocab = self.vocab_size()
        if len(ids) < 2 or not all(0 <= t < vocab for t in ids):
            raise PayloadError(f"input_ids must hold at least 2 token ids in 0..{vocab - 1}")
        with self.model_lock:
            return {"logprobs": score(self.model.module, ids), "weight_version": self.version}

    def distrust(self, version: int, reason: str) -> None:
        """The trainer's probe found that this engine does not compute with the weights of
        `version`: gated generation is refused until a later version is committed."""
        with self.state:
            if version == self.version:
                self.distrusted = {"version": version, "reason": str(reason)[:500]}
                self.state.notify_all()

    def _step_gate(self, epoch: list[int]) -> Callable[[int], None]:
        def gate(k: int) -> None:
            with self.state:
                if k == 0:
                    epoch[0] = self.pause_epoch
                armed = self.pause_at
                if armed is not None and self.sampler is not None and self.sampler.tokens >= armed[1]:
                    self.pause_at, self.paused = None, armed[0]
                    self.last_pause = armed[0]
                while self.paused in ("keep", "keep_stale_kv"):
                    self.state.wait()
                if self.paused == "abort" or (self.pause_epoch != epoch[0] and self.paused is not None):
                    raise Aborted()
        return gate

    def _locked(self, fn: Callable[[int], Any]) -> tuple[Any, int]:
        """`fn(version)` under the model lock: the weights cannot change while it runs."""
        with self.model_lock:
            return fn(self.version), self.version

    def _gate(self, min_version: int | None, exact_version: int | None, wait: float) -> None:
        """Wait for resume, and for a version that fits the request, up to `wait` seconds."""
        def fits() -> bool:
            v = self.version
            bad = self.distrusted is not None and self.distrusted["version"] == v
            if bad and (min_version is not None or exact_version is not None):
                return False                 # the probe failed on what it holds
            return (min_version is None or v >= min_version) and (exact_version is None or v == exact_version)
        deadline = time.monotonic() + max(0.0, min(float(wait), 3600.0))
        with self.state:
            while True:
                if exact_version is not None and self.version > exact_version:
                    raise VersionGate(f"version {exact_version} was asked for, this engine holds "
                                      f"{self.version} already", self.version)
                if self.paused is None and fits():
                    return
                left = deadline - time.monotonic()
                if not fits() and left <= 0:
                    want = (f"version >= {min_version}" if exact_version is None
                            else f"version {exact_version}")
                    d = self.distrusted
                    why = (f" (its probe failed: {d['reason']})"
                           if d is not None and d["version"] == self.version else "")
                    raise VersionGate(f"{want} was asked for, this engine holds {self.version}{why}",
                                      self.version)
                self.state.wait(timeout=left if not fits() else None)

