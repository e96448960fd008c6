"""What a rollout asks for and what it gets back, the same for every engine: sampling parameters,
a version gate, and Samples that carry their tokens, the logprob of every sampled token and the
weight version(s) they were generated with. Plain data: no engine and no transport here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import WeightSyncError

__all__ = ["Gate", "NotFitting", "Refused", "Sample", "SamplingParams", "StaleEngines",
           "Unsupported"]


class SamplingParams(BaseModel):
    """How to sample. `temperature: 0` is greedy; `top_k: 0` and `top_p: 1` are off. Logprobs
    are always returned. A sample ends after `max_new_tokens` or at a token of `stop_token_ids`
    (the model's own end-of-sequence token only when listed there)."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=1024, description="samples per prompt")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: off")
    seed: int | None = Field(None, ge=0, lt=2**63, description="sample i of a prompt uses seed + i")
    max_new_tokens: int = Field(16, ge=0, le=100_000)
    stop_token_ids: list[int] = Field(default_factory=list)

    def asked(self) -> set[str]:
        """The parameters set away from their defaults: what an engine must honour."""
        default = SamplingParams()
        return {k for k in type(self).model_fields if getattr(self, k) != getattr(default, k)}


class Gate(BaseModel):
    """Which weight versions may serve a request: at least `min_version`, or exactly
    `exact_version`; wait up to `wait` seconds for one."""

    model_config = ConfigDict(extra="forbid")
    min_version: int | None = None
    exact_version: int | None = None
    wait: float = Field(30.0, ge=0.0, le=3600.0)

    def fits(self, version: int | None) -> TypeGuard[int]:
        return (version is not None and (self.min_version is None or version >= self.min_version)
                and (self.exact_version is None or version == self.exact_version))

    def describe(self) -> str:
        if self.exact_version is not None:
            return f"version {self.exact_version}"
        return "any version" if self.min_version is None else f"version >= {self.min_version}"


@dataclass
class Sample:
    """One generated sequence. `version` / `version_end`: the weight versions of its first and
    last token (they differ after a swap: `mixed`); `token_versions`: every token's, where known.
    `stale_kv`: tokens after a swap were computed over the old weights' KV cache. `temperature`,
    `top_k`, `top_p`: which distribution `logprobs` are of, so a trainer computes its side alike."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine: str
    version: int
    version_end: int
    prompt_ids: list[int] = field(default_factory=list)
    prompt_index: int = 0
    temperature: float = 1.0        # the logprobs' temperature (1: raw logits; greedy reports 1)
    top_k: int = 0                  # > 0: renormalised over the top-k tokens
    top_p: float = 1.0              # < 1: renormalised over the top-p nucleus
    token_versions: list[int] = field(default_factory=list)
    stale_kv: bool = False

    @property
    def mixed(self) -> bool:
        return self.version != self.version_end

    def versions(self) -> list[int] | None:
        """The weight version of each token; None where unknown (a mixed sample)."""
        if self.token_versions:
            return list(self.token_versions)
        return None if self.mixed else [self.version] * len(self.token_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Sample":
        try:
            s = cls(token_ids=[int(x) for x in d["token_ids"]],
                    logprobs=[float(x) for x in d["logprobs"]],
                    finish_reason=str(d["finish_reason"]), engine=str(d["engine"]),
                    version=int(d["version"]), version_end=int(d["version_end"]),
                    prompt_ids=[int(x) for x in d.get("prompt_ids", [])],
                    prompt_index=int(d.get("prompt_index", 0)),
                    temperature=float(d.get("temperature", 1.0)), top_k=int(d.get("top_k", 0)),
                    top_p=float(d.get("top_p", 1.0)),
                    token_versions=[int(x) for x in d.get("token_versions", [])],
                    stale_kv=bool(d.get("stale_kv", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a sample: {e!r} in {str(d)[:200]}") from None
        if len(s.logprobs) != len(s.token_ids):
            raise ValueError(f"a sample has {len(s.token_ids)} tokens but {len(s.logprobs)} logprobs")
        if s.token_versions and (len(s.token_versions) != len(s.token_ids)
                                 or s.token_versions[0] != s.version
                                 or s.token_versions[-1] != s.version_end):
            raise ValueError(f"a sample's token_versions do not fit its {len(s.token_ids)} tokens "
                             f"of versions {s.version}..{s.version_end}")
        return s


class NotFitting(WeightSyncError):
    """This engine holds no version the gate admits (or moved); `held` is what it holds."""

    def __init__(self, message: str, held: int | None) -> None:
        super().__init__(message)
        self.held = held


class Unsupported(WeightSyncError):
    """The engine cannot honour a sampling parameter: raised before anything is sent."""


class StaleEngines(WeightSyncError):
    """No engine held a fitting version within the wait; says what each one holds."""

    def __init__(self, message: str, held: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.held = held or {}


class Refused(WeightSyncError):
    """An engine refused a generation request as malformed (an HTTP 4xx): the caller's to fix; no
    other engine is tried and the engine is not marked down."""
