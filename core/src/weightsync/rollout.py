"""Version gating for rollouts: send a generation only to an engine whose weights are recent
enough, the way slime's request hook does (a minimum version, or an exact one, with retries and a
staleness allowance). What is guaranteed depends on the engine:

- weightsync's reference engine gates on the server: it waits for a fitting version (up to
  `wait`) before it generates, and answers 409 with the version it holds otherwise; an exact
  request whose weights change mid-generation is refused. Guaranteed.
- vLLM: the version is read from `/weight_info` before the request and checked again after it;
  a request during which the version changed is retried. Best effort: a swap between the check
  and the first token is caught only by the second check.
- SGLang: the version is read from `/model_info` before and after, as for vLLM; SGLang also
  reports `weight_version` in each answer's meta_info, which is preferred when present.

    client = RolloutClient([{"url": "http://e1:8100", "engine": "reference"},
                            {"url": "http://e2:8000", "engine": "vllm", "api_key": "k"}])
    out = client.generate([1, 2, 3], 32, min_version=step - 1)   # staleness of one version
    out["weight_version"], out["engine"]
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from .errors import WeightSyncError


class StaleEngines(WeightSyncError):
    """No engine held a fitting version within the wait; says what each one holds."""


@dataclass
class Target:
    url: str
    engine: str = "reference"
    api_key: str | None = None
    model: str | None = None                   # vLLM/SGLang: the served model name (default: first)
    last_version: int | None = field(default=None, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _fits(v: int | None, min_version: int | None, exact_version: int | None) -> bool:
    if v is None:
        return False
    return (min_version is None or v >= min_version) and (exact_version is None or v == exact_version)


class RolloutClient:
    """Round-robins generation requests over engines whose version fits."""

    def __init__(self, engines: list[dict[str, Any] | Target], *, timeout: float = 120.0,
                 staleness: int = 0) -> None:
        self.targets = [e if isinstance(e, Target) else Target(**e) for e in engines]
        if not self.targets:
            raise ValueError("RolloutClient needs at least one engine")
        self.timeout = timeout
        self.staleness = staleness
        self.session = requests.Session()
        self._next = itertools.cycle(range(len(self.targets)))

    # -- versions -------------------------------------------------------------------------------
    def version(self, t: Target) -> int | None:
        """What the engine says it holds (None: it did not answer)."""
        try:
            if t.engine == "vllm":
                r = self.session.get(t.url + "/weight_info", headers=t.headers, timeout=10)
                raw = r.json().get("weight_version")
            elif t.engine == "sglang":
                r = self.session.get(t.url + "/model_info", headers=t.headers, timeout=10)
                raw = r.json().get("weight_version")
            else:
                r = self.session.get(t.url + "/health", timeout=10)
                raw = r.json().get("weight_version")
            v = int(str(raw)) if raw not in (None, "") else 0
        except (requests.RequestException, ValueError, AttributeError):
            return None
        t.last_version = v
        return v

    # -- generation -------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int, *, min_version: int | None = None,
                 exact_version: int | None = None, wait: float = 30.0, retries: int = 3,
                 **extra: Any) -> dict[str, Any]:
        """Greedy tokens from an engine holding a fitting version: `min_version` (minus the
        client's `staleness`) or `exact_version`. Waits up to `wait` seconds for one; raises
        StaleEngines saying what each engine holds when none fits."""
        if min_version is not None:
            min_version -= self.staleness
        deadline = time.monotonic() + wait
        attempt = 0
        while True:
            for _ in range(len(self.targets)):
                t = self.targets[next(self._next)]
                if t.engine != "reference" and not _fits(self.version(t), min_version, exact_version):
                    continue
                out = self._one(t, input_ids, max_new_tokens, min_version, exact_version,
                                max(0.0, deadline - time.monotonic()), extra)
                if out is not None:
                    return out
                attempt += 1
                if attempt > retries * len(self.targets):
                    break
            if time.monotonic() >= deadline:
                held = {t.url: t.last_version for t in self.targets}
                want = f"version >= {min_version}" if exact_version is None else f"version {exact_version}"
                raise StaleEngines(f"no engine held {want} within {wait:g}s; they hold {held}")
            time.sleep(0.05)

    def _one(self, t: Target, ids: list[int], n: int, min_version: int | None,
             exact_version: int | None, wait: float, extra: dict[str, Any]) -> dict[str, Any] | None:
        if t.engine == "reference":
            body = {"input_ids": ids, "max_new_tokens": n, "min_version": min_version,
                    "exact_version": exact_version, "wait": wait}
            try:
                r = self.session.post(t.url + "/generate", json=body, headers=t.headers,
                                      timeout=self.timeout + wait)
            except requests.RequestException:
                return None
            if r.status_code == 409:
                t.last_version = r.json().get("weight_version")
                return None
            r.raise_for_status()
            out = r.json()
            t.last_version = out.get("weight_version")
            return {**out, "engine": t.url}
        model = t.model or self._model(t)
        body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0,
                "return_token_ids": True, **extra}
        if t.engine == "sglang":
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}
        path = "/v1/completions" if t.engine == "vllm" else "/generate"
        try:
            r = self.session.post(t.url + path, json=body, headers=t.headers, timeout=self.timeout)
            r.raise_for_status()
            out = r.json()
        except (requests.RequestException, ValueError):
            return None
        after = self.version(t)
        meta = out.get("meta_info") or {}
        v = meta.get("weight_version", after)
        try:
            v = int(str(v))
        except ValueError:
            v = after
        if not _fits(v, min_version, exact_version) or not _fits(after, min_version, exact_version):
            return None                       # the weights moved during the request: retry
        if t.engine == "vllm":
            choice = out["choices"][0]
            return {"output_ids": choice.get("token_ids") or [], "finish_reason": choice.get("finish_reason"),
                    "weight_version": v, "engine": t.url}
        return {"output_ids": out.get("output_ids") or [], "finish_reason": (meta.get("finish_reason") or {}).get("type"),
                "weight_version": v, "engine": t.url}

    def _model(self, t: Target) -> str:
        r = self.session.get(t.url + "/v1/models", headers=t.headers, timeout=10)
        t.model = r.json()["data"][0]["id"]
        return t.model

    def close(self) -> None:
        self.session.close()
