"""Rollouts and scoring on a live vLLM server through its OpenAI completions route: the `vllm`
sampler (RL's interface, `VllmSampler`) and the adapter's `score` build and read these. vLLM takes token-id prompts (`prompt: [ids]`) and returns token ids and the sampled
token's logprob per position (`return_token_ids`, `logprobs: 0`)."""

from __future__ import annotations

import logging
from typing import Any

from weightsync.errors import EngineError
from weightsync.net.client import json_of
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams

log = logging.getLogger(__name__)

# vLLM's default `raw_logprobs` is the log-softmax of the model's logits before the temperature
# is applied: it equals SamplingParams' definition (temperature-scaled, before top-k / top-p) only
# at temperature 1. `processed_logprobs` is taken after the temperature (and, in greedy requests,
# of the unscaled logits: temperature 1, as defined), so it equals the definition at every
# temperature as long as top_k / top_p are off. With top_k or top_p on, vLLM renormalizes over the
# kept tokens before taking the logprob: the sampling distribution itself, which differs from the
# definition by the log of the kept mass (see the plugin README).
LOGPROBS_ARGS = ["--logprobs-mode", "processed_logprobs"]

SAMPLING = frozenset(SamplingParams.model_fields)


def completion_body(prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """The /v1/completions body for `params.n` samples of a token-id prompt. vLLM gives child i
    of a request with `seed` the seed `seed + i` (vllm.v1.engine.parallel_sampling), so one
    request with n and seed makes sample i reproducible on its own, as SamplingParams defines."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt], "n": params.n, "max_tokens": params.max_new_tokens,
        "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k,                  # vLLM: 0 (or -1) is off, as in SamplingParams
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,                     # only the stop ids stop a sample
        "logprobs": 0,                          # the sampled token's logprob only
        "return_token_ids": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def parse_choices(engine: str, body: Any, n: int) -> list[tuple[list[int], list[float], str]]:
    """(token ids, logprobs, finish reason) per sample, in sample order, from a completions
    answer; an answer without token ids or with a logprob missing is refused, never padded."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise EngineError(engine, f"/v1/completions answered {len(choices or [])} choices for "
                                  f"n={n}: {str(body)[:300]}")
    out = []
    for c in sorted(choices, key=lambda c: int(c.get("index", 0))):
        ids = c.get("token_ids")
        lp = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lp is None:
            raise EngineError(engine, "/v1/completions answered without token_ids or logprobs "
                                      "(vLLM >= 0.10 returns them with return_token_ids and "
                                      f"logprobs): {str(c)[:300]}")
        if len(lp) != len(ids) or any(x is None for x in lp):
            raise EngineError(engine, f"/v1/completions answered {len(ids)} tokens but logprobs "
                                      f"{lp}")
        out.append(([int(t) for t in ids], [float(x) for x in lp], str(c.get("finish_reason"))))
    return out


def score_body(ids: list[int]) -> dict[str, Any]:
    """Score a sequence: one generated token (vLLM needs one) and the logprob of every prompt
    token given the ones before it (`prompt_logprobs: 0`: the token itself, no top list)."""
    return {"prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0, "return_token_ids": True}


def parse_prompt_logprobs(engine: str, body: Any, ids: list[int]) -> list[float]:
    """The logprob of ids[1:] from a completions answer's `prompt_logprobs` (entry i: a map
    from token id to {logprob, rank, ...}; entry 0 is None, the first token has no context)."""
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(engine, f"/v1/completions answered without prompt_logprobs: "
                                  f"{str(body)[:300]}") from None
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineError(engine, f"prompt_logprobs has {len(entries or [])} entries for "
                                  f"{len(ids)} tokens")
    out = []
    for pos, (tok, entry) in enumerate(zip(ids[1:], entries[1:]), 1):
        hit = (entry or {}).get(str(tok))
        if not isinstance(hit, dict) or "logprob" not in hit:
            raise EngineError(engine, f"prompt_logprobs has no logprob for token {tok} at "
                                      f"position {pos}: {str(entry)[:200]}")
        out.append(float(hit["logprob"]))
    return out


DISTRUSTED = "distrusted-"     # vLLM's weight_version after a failed probe: "distrusted-<v>"


def served_version(adapter: Any) -> int | None:
    """The version `adapter`'s server serves rollouts from (GET /weight_info); None: no answer,
    or the probe failed on what it holds (no version fits any request then)."""
    try:
        raw = (adapter._call("GET", "/weight_info", timeout=adapter.options.timeout) or {})
    except EngineError:
        return None
    got = raw.get("weight_version")
    return None if str(got).startswith(DISTRUSTED) else parse_version(got)


def distrust_on(adapter: Any, version: int, reason: str) -> bool:
    """The trainer's probe found that the server does not compute with the weights of `version`:
    its weight_version becomes "distrusted-<version>" (vLLM's `/update_weight_version`), which
    the sampler reads as no fitting version and the round protocol still as `version`; the next
    commit writes a plain version again. False when it holds another version by now."""
    try:
        raw = (adapter._call("GET", "/weight_info") or {}).get("weight_version")
        if str(raw).startswith(DISTRUSTED) or parse_version(raw) != version:
            return False
        adapter._post("/update_weight_version", {"new_version": f"{DISTRUSTED}{version}"})
    except EngineError:
        return False
    log.warning("engine %s serves no rollouts until a later version: %s", adapter.engine_name,
                reason)
    return True


def completions(adapter: Any, body: dict[str, Any]) -> Any:
    """POST /v1/completions outside any push deadline (a rollout is not part of a push)."""
    try:
        resp = adapter.request("POST", "/v1/completions", timeout=adapter.options.payload_timeout,
                               json=body, ok=(200, 400), push=False)
    except EngineError as e:
        raise adapter._explain(e, "/v1/completions") from None
    out = json_of(resp, adapter.engine_name)
    if resp.status_code == 400:      # vLLM: {"error": {"message", "type", "param", "code"}}
        err = out.get("error") if isinstance(out, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        raise EngineError(adapter.engine_name, f"vLLM refused POST /v1/completions: {msg or out}")
    return out


def score_on(adapter: Any, ids: list[int]) -> tuple[list[float], int]:
    """The logprob of each token of `ids` after the first, and the version that computed them
    (the `vllm` adapter's `score`: the probe's comparison); NotFitting when the version moved."""
    if len(ids) < 2:
        raise ValueError(f"score needs at least 2 tokens (the first has no context); got {ids}")
    held = served_version(adapter)
    body = completions(adapter, score_body(ids))
    end = served_version(adapter)
    if held is None or held != end:
        raise NotFitting(f"engine {adapter.engine_name} moved from version {held} to {end} "
                         f"while scoring", end)
    return parse_prompt_logprobs(adapter.engine_name, body, ids), held


class VllmSampler:
    """Rollouts on the server a `VllmAdapter` drives (its session, headers, base url, options
    and error hints): RL's sampler interface, registered through `register_samplers`."""

    sampling: frozenset[str] = SAMPLING
    gates = False            # vLLM cannot hold a request for a version: the version is read around it

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.engine_name: str = adapter.engine_name

    def weight_version(self) -> int | None:
        return served_version(self.adapter)

    def busy_seconds(self) -> float | None:
        """Not reported: vLLM's OpenAI server has no such counter."""
        return None

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        """One completions request for all `params.n` samples. vLLM cannot hold a request until a
        version arrives, nor tag tokens with one: the version is read before (it must fit the
        gate, else NotFitting at once and the client waits) and after (`version_end`), so a swap
        during the request shows as a mixed sample."""
        held = self.weight_version()
        if not gate.fits(held):
            raise NotFitting(f"engine {self.engine_name} holds version {held}; the request "
                             f"wants {gate.describe()}", held)
        if params.max_new_tokens == 0:      # vLLM refuses max_tokens 0; nothing to generate
            out: list[tuple[list[int], list[float], str]] = [([], [], "length")] * params.n
        else:
            body = self._generation_call(completion_body(prompt, params))
            out = parse_choices(self.engine_name, body, params.n)
            if any(reason == "abort" for _, _, reason in out):
                raise NotFitting(f"engine {self.engine_name} aborted the request (a weight "
                                 f"update paused it with mode abort)", self.weight_version())
        end = self.weight_version()
        if end is None:
            raise NotFitting(f"engine {self.engine_name} did not say which version it held "
                             f"after the request", held)
        # `processed_logprobs`: temperature-scaled, and renormalised over top-k / top-p
        return [Sample(ids, lps, reason, self.engine_name, held, end, list(prompt),
                       temperature=params.temperature or 1.0, top_k=params.top_k,
                       top_p=params.top_p)
                for ids, lps, reason in out]

    def _generation_call(self, body: dict[str, Any]) -> Any:
        return completions(self.adapter, body)


def parse_version(raw: Any) -> int:
    """vLLM's weight_version is a free string (None until set); weightsync writes integers."""
    if raw is None or raw == "":
        return 0
    try:
        return int(str(raw))
    except ValueError:
        digits = "".join(c for c in str(raw).rsplit("-", 1)[-1].rsplit("_", 1)[-1] if c.isdigit())
        return int(digits) if digits else 0
