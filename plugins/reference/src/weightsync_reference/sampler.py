"""The reference engine's sampler (RL's `Sampler` interface, registered by `register_samplers`):
rollouts from `POST /generate`, gated on the server, and the engine's version and busy time."""

from __future__ import annotations

from weightsync.errors import EngineError, WeightSyncError
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams
from weightsync.net.client import json_of
from weightsync_reference.adapter import ReferenceAdapter

__all__ = ["ReferenceSampler"]


class ReferenceSampler:
    """Generates on the engine a `ReferenceAdapter` drives (its session, key and options)."""

    sampling = frozenset(SamplingParams.model_fields)
    gates = True

    def __init__(self, adapter: ReferenceAdapter) -> None:
        self.adapter = adapter

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        """The engine gates on the server: it waits up to `gate.wait` for a fitting version."""
        a = self.adapter
        body = {"input_ids": prompt, "sampling": params.model_dump(), "wait": gate.wait,
                "min_version": gate.min_version, "exact_version": gate.exact_version}
        resp = a.request("POST", "/generate", json=body, ok=(200, 409), push=False,
                         timeout=gate.wait + a.options.generate_timeout)
        out = json_of(resp, a.engine_name) or {}
        if resp.status_code == 409:
            raise NotFitting(f"{a.engine_name}: {out.get('error', out)}", out.get("weight_version"))
        try:
            return [Sample(token_ids=s["output_ids"], logprobs=s["logprobs"],
                           finish_reason=s["finish_reason"], engine=a.engine_name,
                           version=int(s["weight_version"]), version_end=int(s["weight_version_end"]),
                           prompt_ids=list(prompt), temperature=params.temperature or 1.0,
                           token_versions=[int(v) for v in s.get("weight_versions", [])],
                           stale_kv=bool(s.get("stale_kv", False)))
                    for s in out["samples"]]     # temperature-scaled, before top-k / top-p
        except (KeyError, TypeError, ValueError):
            raise EngineError(a.engine_name, f"/generate answered without samples: "
                                             f"{str(out)[:200]}") from None

    def weight_version(self) -> int | None:
        """None while the engine's probe failed on what it holds (it serves no gated request)."""
        try:
            st = self.adapter.health()
        except WeightSyncError:
            return None
        bad = st.info.get("distrusted")
        return None if bad and bad.get("version") == st.version else st.version

    def busy_seconds(self) -> float | None:
        a = self.adapter
        resp = a.request("GET", "/info", push=False)
        return float((json_of(resp, a.engine_name) or {}).get("busy_seconds", 0.0))
