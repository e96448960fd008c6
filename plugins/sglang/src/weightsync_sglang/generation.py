"""Rollouts on an SGLang server through its native `POST /generate` (GenerateReqInput): token-id
prompts, `return_logprob` for the sampled tokens' logprobs (`meta_info.output_token_logprobs`,
[logprob, token id, text] per token) and `meta_info.weight_version`, the version SGLang holds
when it answers. Nothing of SGLang is imported. `SGLangSampler` implements RL's sampler interface
structurally, so this plugin does not depend on weightsync_rl."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.errors import EngineError
from weightsync.net.client import error_text
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams, Unsupported

if TYPE_CHECKING:
    from .adapter import SGLangAdapter

SAMPLING = frozenset(SamplingParams.model_fields)
DETERMINISTIC = "--enable-deterministic-inference"


def generate_body(prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """A batch of `params.n` copies of the prompt, one sampling_params each: sample i gets
    `sampling_seed` seed + i, so it is reproducible on its own (SGLang's own `n` would give every
    copy the same seed). SGLang's top_k switches off at -1 (0 is refused)."""
    def one(i: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": params.max_new_tokens,
                              "temperature": params.temperature, "top_p": params.top_p,
                              "top_k": params.top_k if params.top_k > 0 else -1,
                              "ignore_eos": True}      # only the stop ids stop a sample
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["sampling_seed"] = params.seed + i
        return sp
    return {"input_ids": [[int(t) for t in prompt] for _ in range(params.n)],
            "sampling_params": [one(i) for i in range(params.n)], "return_logprob": True}


def parse_output(engine: str, out: Any) -> tuple[list[int], list[float], str, Any]:
    """(token ids, logprobs, finish reason, meta weight_version) of one /generate answer item."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or not isinstance(out.get("output_ids"), list):
        raise EngineError(engine, f"/generate answered without output_ids or meta_info: {str(out)[:300]}")
    ids = [int(t) for t in out["output_ids"]]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or len(triples) != len(ids):
        raise EngineError(engine, f"/generate answered {len(ids)} tokens but output_token_logprobs "
                                  f"{str(triples)[:200]} (is return_logprob supported?)")
    lps = []
    for pos, (t, triple) in enumerate(zip(ids, triples)):
        if not isinstance(triple, list | tuple) or triple[0] is None or int(triple[1]) != t:
            raise EngineError(engine, f"output_token_logprobs[{pos}] is {triple}, not "
                                      f"[logprob, {t}, text]")
        lps.append(float(triple[0]))
    reason = (meta.get("finish_reason") or {}).get("type") if isinstance(meta.get("finish_reason"), dict) \
        else meta.get("finish_reason")
    return ids, lps, str(reason), meta.get("weight_version")


class SGLangSampler:
    """Rollouts on the SGLang server an `SGLangAdapter` drives (its session, key and options);
    registered for adapter `sglang` through RL's hook `register_samplers`. SGLang cannot hold a
    request until a version arrives, so the client reads the version around it (`gates` False)."""

    sampling: frozenset[str] = SAMPLING
    gates: bool = False

    def __init__(self, adapter: "SGLangAdapter") -> None:
        self.adapter = adapter
        self._seeded: bool | None = None

    def weight_version(self) -> int | None:
        try:
            return self.adapter.model_info()[0]      # "default" (a fresh engine) is version 0
        except EngineError:
            return None

    def busy_seconds(self) -> float | None:
        """SGLang reports no busy time."""
        return None

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        """One batched /generate. SGLang cannot hold a request until a version arrives: the
        version is read before (it must fit the gate, else NotFitting at once) and is the
        samples' `version`; `version_end` is the weight_version SGLang reports with its answer
        (a swap during the request, under an in-place pause, shows as a mixed sample)."""
        a = self.adapter
        if params.seed is not None:
            self._check_seeded()
        held = self.weight_version()
        if not gate.fits(held):
            raise NotFitting(f"engine {a.engine_name} holds version {held}; the request "
                             f"wants {gate.describe()}", held)
        resp = a.request("POST", "/generate", timeout=a.options.update_timeout, ok=(200, 400),
                         push=False, json=generate_body(prompt, params))
        if resp.status_code != 200:
            raise EngineError(a.engine_name, f"SGLang refused POST /generate: {_message(resp)}")
        outs = resp.json()
        if not isinstance(outs, list) or len(outs) != params.n:
            raise EngineError(a.engine_name, f"/generate answered {str(outs)[:200]} for a "
                                             f"batch of {params.n}")
        samples = []
        after: int | None = None
        for out in outs:
            ids, lps, reason, raw = parse_output(a.engine_name, out)
            if reason == "abort":
                raise NotFitting(f"engine {a.engine_name} aborted the request (a weight "
                                 f"update paused it with mode abort)", self.weight_version())
            if raw is None:              # an SGLang that does not report it: read it now
                after = after if after is not None else self.weight_version()
                end = after
            else:
                end = a.version_of(raw)
            if end is None:
                raise NotFitting(f"engine {a.engine_name} did not say which version it held "
                                 f"after the request", held)
            # SGLang's sampler reports the log of the temperature-scaled probabilities, before
            # its top-k / top-p filters
            samples.append(Sample(ids, lps, reason, a.engine_name, int(held), end, list(prompt),
                                  temperature=params.temperature or 1.0))
        return samples

    def _check_seeded(self) -> None:
        """SGLang draws with `sampling_seed` only when it runs deterministic inference; any other
        server ignores the seed, so a seeded request is refused there instead of being sampled
        unseeded."""
        a = self.adapter
        if self._seeded is None:
            resp = a._request("GET", "/get_server_info")
            try:
                info = resp.json() if resp.status_code == 200 else {}
            except ValueError:
                info = {}
            self._seeded = bool(isinstance(info, dict) and info.get("enable_deterministic_inference"))
        if not self._seeded:
            raise Unsupported(f"engine {a.engine_name}: SGLang applies a seed (sampling_seed) "
                              f"only when started with {DETERMINISTIC}; restart it so, or leave "
                              f"`seed` unset")


def _message(resp: Any) -> str:
    """SGLang answers a bad /generate with 400 {"error": {"message": ...}}."""
    try:
        body = resp.json()
    except ValueError:
        return error_text(resp)
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return error_text(resp)
