"""The trainer's side of the router: `RouterClient(url).sample(...)` returns the same Samples as
`RolloutClient.sample`, over one HTTP endpoint for the whole fleet."""

from __future__ import annotations

from typing import Any

import requests

from weightsync.interfaces.sampling import Sample, SamplingParams, StaleEngines, Unsupported


class RouterClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def sample(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None,
               *, min_version: int | None = None, exact_version: int | None = None,
               wait: float = 30.0, mixed: str = "retry") -> list[Sample]:
        p = params if isinstance(params, SamplingParams) else SamplingParams.model_validate(params or {})
        body = {"prompts": prompts, "sampling": p.model_dump(), "min_version": min_version,
                "exact_version": exact_version, "wait": wait, "mixed": mixed}
        r = self.session.post(self.url + "/generate", json=body, timeout=wait + self.timeout)
        out = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code == 503:
            raise StaleEngines(out.get("error", r.text), out.get("held"))
        if r.status_code == 400 and "cannot honour" in str(out.get("error", "")):
            raise Unsupported(out["error"])
        if r.status_code != 200:
            raise RuntimeError(f"router {self.url} answered HTTP {r.status_code}: {out.get('error', r.text[:300])}")
        return [Sample.from_json(s) for s in out["samples"]]

    def members(self) -> dict[str, Any]:
        r = self.session.get(self.url + "/members", timeout=30)
        r.raise_for_status()
        return r.json()["members"]

    def close(self) -> None:
        self.session.close()
