"""Rollouts through `LmdeploySampler` (the lmdeploy adapter's sampler), against the stand-in's
/generate (made-up tokens and logprobs: these tests check what the sampler sends, reads and
refuses, and the versions it reports), with request bodies validated by LMDeploy 0.18's own GenerateReqInput."""

from __future__ import annotations

from typing import Any

import lmd_real
import pytest
from lmd_standin import standin_logprob
from weightsync import WeightSync
from weightsync.config import EngineSpec
from weightsync.errors import EngineError
from weightsync.interfaces.sampling import Gate, NotFitting, SamplingParams, Unsupported
from weightsync_lmdeploy import adapter as adapter_mod
from weightsync_lmdeploy.adapter import LmdeployAdapter, LmdeployOptions
from weightsync_lmdeploy.generation import SAMPLING, LmdeploySampler, generate_body

proto, PROTO_WHY = lmd_real.load("lmdeploy.serve.openai.protocol")
needs_proto = pytest.mark.skipif(proto is None, reason=f"cannot check against LMDeploy: {PROTO_WHY}")
PROMPT = [1, 17, 42, 99]


def _adapter(eng: Any) -> LmdeployAdapter:
    spec = eng.spec()
    return LmdeployAdapter(LmdeployOptions(**spec.pop("options")), EngineSpec(**spec))


def _push(eng: Any, sd: dict, version: int) -> None:
    cfg = {"exporter": {"kind": "torch", "options": {"bucket_bytes": 1500}}, "transport": "lmdeploy_ipc",
           "adapter": {"kind": "lmdeploy", "options": {"ipc_device": "cpu"}}, "engines": [eng.spec()]}
    with WeightSync.from_config(cfg) as sync:
        assert sync.push(sd, version=version).ok


@needs_proto
def test_bodies_are_lmdeploys_generate_request() -> None:
    """Every value the adapter sends is a GenerateReqInput field LMDeploy reads (none ignored),
    greedy is top_k 1 at temperature 1, and top_k 0 is sent (LMDeploy's default would be 50)."""
    for params in (SamplingParams(temperature=0, max_new_tokens=5),
                   SamplingParams(top_p=0.8, top_k=0, stop_token_ids=[2, 7], max_new_tokens=9)):
        body = generate_body(PROMPT, params)
        assert set(body) <= set(proto.GenerateReqInput.model_fields)
        req = proto.GenerateReqInput.model_validate(body)
        assert req.input_ids == PROMPT and req.return_logprob is True
        assert req.max_tokens == params.max_new_tokens and req.top_p == params.top_p
        assert req.stop_token_ids == (params.stop_token_ids or None)
        assert (req.temperature, req.top_k) == ((1.0, 1) if params.temperature == 0 else (1.0, 0))
    assert "seed" not in SAMPLING and SAMPLING | {"seed"} == set(SamplingParams.model_fields)
    assert "seed" not in proto.GenerateReqInput.model_fields and "n" not in proto.GenerateReqInput.model_fields


def test_version_is_unknown_until_this_process_commits_one(standin: Any, model_factory: Any,
                                                           version_factory: Any) -> None:
    sd = model_factory()
    eng = standin(sd)
    a = _adapter(eng)
    r = LmdeploySampler(a)
    adapter_mod.versions.pop(a.base, None)
    assert r.weight_version() is None and a.health().version == 0    # the push path starts at 0
    with pytest.raises(NotFitting, match="LMDeploy has no weight version, and this process has "
                                         "committed none") as e:
        r.generate(PROMPT, SamplingParams(), Gate())
    assert e.value.held is None and eng.stats().get("generate", 0) == 0
    _push(eng, version_factory(sd, 1), 4)
    assert r.weight_version() == 4
    samples = r.generate(PROMPT, SamplingParams(n=3, max_new_tokens=6), Gate(exact_version=4))
    assert len(samples) == 3 and eng.stats()["generate"] == 3       # n requests: no n in LMDeploy
    for s in samples:
        assert (s.version, s.version_end, s.engine, s.prompt_ids) == (4, 4, a.engine_name, PROMPT)
        assert len(s.token_ids) == 6 and s.finish_reason == "length"
        assert s.logprobs == [standin_logprob(t) for t in s.token_ids]
    with pytest.raises(NotFitting, match="it holds version 4; the request wants version >= 5"):
        r.generate(PROMPT, SamplingParams(), Gate(min_version=5))


def test_greedy_stop_tokens_and_what_lmdeploy_cannot_honour(standin: Any, model_factory: Any) -> None:
    eng = standin(model_factory())
    a = _adapter(eng)
    r = LmdeploySampler(a)
    adapter_mod.versions[a.base] = 0
    try:
        (g,) = r.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=5), Gate())
        (g2,) = r.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=5), Gate())
        assert g.token_ids == g2.token_ids
        (s,) = r.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=5,
                                                 stop_token_ids=[g.token_ids[2]]), Gate())
        assert s.finish_reason == "stop" and s.token_ids == g.token_ids[:2]   # LMDeploy drops it
        with pytest.raises(Unsupported, match="at temperature 0.7; use temperature 1 or 0"):
            r.generate(PROMPT, SamplingParams(temperature=0.7), Gate())
        (empty,) = r.generate(PROMPT, SamplingParams(max_new_tokens=0), Gate())
        assert empty.token_ids == [] and empty.logprobs == []
    finally:
        adapter_mod.versions.pop(a.base, None)


def test_asleep_is_not_fitting_and_missing_logprobs_mode_is_named(standin: Any, model_factory: Any) -> None:
    eng = standin(model_factory())
    a = _adapter(eng)
    r = LmdeploySampler(a)
    adapter_mod.versions[a.base] = 2
    try:
        a.pause("abort")
        with pytest.raises(NotFitting, match="is asleep .*Engine is sleeping") as e:
            r.generate(PROMPT, SamplingParams(), Gate())
        assert e.value.held == 2
        a.resume()
        assert len(r.generate(PROMPT, SamplingParams(max_new_tokens=2), Gate())[0].token_ids) == 2
    finally:
        adapter_mod.versions.pop(a.base, None)
    plain = standin(model_factory(), logprobs_mode=None)
    b = _adapter(plain)
    rb = LmdeploySampler(b)
    adapter_mod.versions[b.base] = 0
    try:
        with pytest.raises(EngineError, match=r"return_logprob\(True\) requested but not enabled "
                                              r"logprobs_mode .* -> start the api_server with "
                                              r"--logprobs-mode raw_logprobs"):
            rb.generate(PROMPT, SamplingParams(), Gate())
    finally:
        adapter_mod.versions.pop(b.base, None)
