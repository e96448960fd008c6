"""Rollouts on an LMDeploy api_server through its own `POST /generate` (GenerateReqInput of
lmdeploy.serve.openai.protocol): token-id prompts, `return_logprob` for the sampled tokens'
logprobs (`meta_info.output_token_logprobs`, [logprob, token id] pairs).

`LmdeploySampler` implements RL's sampler interface structurally (this plugin does not depend on
weightsync_rl). What LMDeploy 0.18's route lacks, and what the sampler does about it:
- No seed and no `n`: `seed` is not in `sampling` (the rollout client refuses it), and n samples
  are n requests, sent together (LMDeploy batches them).
- Logprobs only in `--logprobs-mode raw_logprobs` (the log-softmax of the logits before the
  temperature and any filter): equal to SamplingParams' definition at temperature 1 and greedy,
  not at any other temperature, so another temperature is refused (Unsupported).
- No weight version: the version is the one this trainer process last committed through the
  adapter (`weightsync_lmdeploy.adapter.versions`, `LmdeployAdapter.committed_version`);
  unknown (None) elsewhere, and an engine whose version is unknown fits no gate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import requests
from weightsync.errors import EngineError
from weightsync.net.client import call
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams, Unsupported

if TYPE_CHECKING:
    from .adapter import LmdeployAdapter

SAMPLING = frozenset(SamplingParams.model_fields) - {"seed"}
LOGPROBS_FLAG = "--logprobs-mode raw_logprobs"


def generate_body(prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One GenerateReqInput. Every sampling value is sent, none left to the server's defaults
    (LMDeploy's own top_k default is 50). Greedy is top_k 1 at temperature 1: the same tokens,
    and the logprobs of temperature 1 as SamplingParams defines them for greedy."""
    greedy = params.temperature == 0
    body: dict[str, Any] = {"input_ids": [int(t) for t in prompt], "max_tokens": params.max_new_tokens,
                            "temperature": 1.0 if greedy else params.temperature,
                            "top_p": params.top_p, "top_k": 1 if greedy else params.top_k,
                            "return_logprob": True,
                            "ignore_eos": True}       # only the stop ids stop a sample
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def parse_output(engine: str, out: Any) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason) of one GenerateReqOutput."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or not isinstance(out.get("output_ids"), list):
        raise EngineError(engine, f"/generate answered without output_ids or meta_info: {str(out)[:300]}")
    ids = [int(t) for t in out["output_ids"]]
    pairs = meta.get("output_token_logprobs") or []
    if len(pairs) != len(ids):
        raise EngineError(engine, f"/generate answered {len(ids)} tokens but {len(pairs)} logprobs "
                                  f"(is the server started with {LOGPROBS_FLAG}?)")
    lps = []
    for pos, (t, pair) in enumerate(zip(ids, pairs)):
        if not isinstance(pair, list | tuple) or len(pair) < 2 or int(pair[1]) != t:
            raise EngineError(engine, f"output_token_logprobs[{pos}] is {pair}, not [logprob, {t}]")
        lps.append(float(pair[0]))
    reason = (meta.get("finish_reason") or {}).get("type")
    return ids, lps, str(reason)


class LmdeploySampler:
    """Rollouts on the LMDeploy api_server an `LmdeployAdapter` drives (its key and options);
    registered for adapter `lmdeploy` through RL's hook `register_samplers`. LMDeploy cannot
    hold a request for a version, so the client reads the version around it (`gates` False)."""

    sampling: frozenset[str] = SAMPLING
    gates: bool = False

    def __init__(self, adapter: "LmdeployAdapter") -> None:
        self.adapter = adapter

    def weight_version(self) -> int | None:
        """The version this process last committed to the engine; None when it committed none."""
        return self.adapter.committed_version()

    def busy_seconds(self) -> float | None:
        """LMDeploy reports no busy time."""
        return None

    def generate(self, prompt: list[int], params: SamplingParams, gate: Gate) -> list[Sample]:
        name = self.adapter.engine_name
        if params.temperature not in (0.0, 1.0):
            raise Unsupported(f"engine {name}: LMDeploy returns logprobs of the "
                              f"distribution before the temperature (raw_logprobs), which differ "
                              f"from the sampled ones at temperature {params.temperature}; use "
                              f"temperature 1 or 0 with this engine")
        held = self.weight_version()
        if not gate.fits(held):
            why = ("LMDeploy has no weight version, and this process has committed none through "
                   "the lmdeploy adapter" if held is None else f"it holds version {held}")
            raise NotFitting(f"engine {name}: {why}; the request wants "
                             f"{gate.describe()}", held)
        if params.max_new_tokens == 0:        # LMDeploy refuses max_tokens 0: nothing to generate
            outs: list[tuple[list[int], list[float], str]] = [([], [], "length")] * params.n
        else:
            body = generate_body(prompt, params)
            with ThreadPoolExecutor(min(params.n, 16)) as pool:
                outs = list(pool.map(lambda _: self._generate_one(body, held), range(params.n)))
        end = self.weight_version()
        if end is None:
            raise NotFitting(f"engine {name}: its version became unknown during the "
                             f"request", held)
        return [Sample(ids, lps, reason, name, int(held), end, list(prompt))
                for ids, lps, reason in outs]

    def _generate_one(self, body: dict[str, Any], held: int | None) -> tuple[list[int], list[float], str]:
        a = self.adapter
        with requests.Session() as s:     # one per thread: a Session is not shared across threads
            resp = call(s, a.engine_name, "POST", a.base + "/generate",
                        timeout=a.options.payload_timeout, ok=(200, 400, 503),
                        headers=a.headers, json=body)
        out = _json(resp)
        if resp.status_code == 503:
            raise NotFitting(f"engine {a.engine_name} is asleep (a weight update is under way): "
                             f"{_message(out)}", held)
        if resp.status_code != 200:
            msg = _message(out)
            hint = f" -> start the api_server with {LOGPROBS_FLAG}" if "logprobs_mode" in msg else ""
            raise EngineError(a.engine_name, f"LMDeploy refused POST /generate: {msg}{hint}")
        ids, lps, reason = parse_output(a.engine_name, out)
        if reason == "abort":
            raise NotFitting(f"engine {a.engine_name} cancelled the request (a weight update "
                             f"put it to sleep)", held)
        return ids, lps, reason


def _json(resp: requests.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return {"message": resp.text[:500]}


def _message(body: Any) -> str:
    """LMDeploy's error envelope: {"message", "type", "code", "param", "object"}."""
    if isinstance(body, dict):
        inner = body.get("error")
        err = inner if isinstance(inner, dict) else body
        if err.get("message"):
            return str(err["message"])
    return str(body)[:500]
