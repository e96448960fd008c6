"""Rollouts through `SGLangSampler` (the sglang adapter's sampler), against the SGLang stand-in's
/generate (the stand-in's tokens and logprobs are made-up functions of its weights: these tests
check what the sampler sends, reads and refuses, and the versions it reports, not a model)."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from weightsync.config import EngineSpec
from weightsync.errors import EngineError
from weightsync.sync.pipeline import WeightSync
from weightsync.interfaces.sampling import Gate, NotFitting, SamplingParams, Unsupported
from weightsync.testing.sample import perturb
from weightsync_sglang import generation
from weightsync_sglang.adapter import SGLangAdapter
from weightsync_sglang.generation import SGLangSampler

PROMPT = [1, 17, 42, 99]
HERE = Path(__file__).parent


def _standin_module():
    spec = importlib.util.spec_from_file_location("sglang_standin_gen", HERE / "standin" / "sglang_standin.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


STANDIN = _standin_module()


def _adapter(engine) -> SGLangAdapter:
    return SGLangAdapter(engine=EngineSpec(**engine.spec()))


def _sampler(engine) -> SGLangSampler:
    return SGLangSampler(_adapter(engine))


def test_fresh_engine_is_version_0_and_greedy_samples_carry_logprobs(start_standin) -> None:
    engine = start_standin()
    a = _sampler(engine)
    assert engine.state()["weight_version"] == "default" and a.weight_version() == 0
    samples = a.generate(PROMPT, SamplingParams(n=3, temperature=0, max_new_tokens=6), Gate(min_version=0))
    assert len(samples) == 3
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == 6 and s.finish_reason == "length"
        assert (s.version, s.version_end, s.engine, s.prompt_ids) == (0, 0, engine.name, PROMPT)
        # greedy: SGLang's logprob at temperature 1, read from [logprob, token id, text] in order
        assert s.logprobs == [STANDIN.standin_logprob(t, 1.0) for t in s.token_ids]
    assert samples[0].token_ids == samples[1].token_ids == samples[2].token_ids


def test_stop_tokens_and_temperature_reach_sglang(start_standin) -> None:
    engine = start_standin()
    a = _sampler(engine)
    (greedy,) = a.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6), Gate())
    stop = greedy.token_ids[2]
    (s,) = a.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop]), Gate())
    assert s.finish_reason == "stop" and s.token_ids == greedy.token_ids[:greedy.token_ids.index(stop) + 1]
    (t,) = a.generate(PROMPT, SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=5), Gate())
    assert t.logprobs == [STANDIN.standin_logprob(x, 0.5) for x in t.token_ids]


def test_seed_needs_deterministic_inference(start_standin) -> None:
    a = _sampler(start_standin())
    with pytest.raises(Unsupported, match="only when started with --enable-deterministic-inference"):
        a.generate(PROMPT, SamplingParams(seed=1), Gate())


def test_sample_i_uses_seed_plus_i(start_standin) -> None:
    a = _sampler(start_standin(deterministic=True))
    params = SamplingParams(n=3, seed=10, max_new_tokens=8)
    samples = a.generate(PROMPT, params, Gate())
    assert len({tuple(s.token_ids) for s in samples}) == 3
    assert [s.token_ids for s in a.generate(PROMPT, params, Gate())] == [s.token_ids for s in samples]
    (third,) = a.generate(PROMPT, params.model_copy(update={"n": 1, "seed": 12}), Gate())
    assert third.token_ids == samples[2].token_ids


def test_body_is_sglangs_and_a_refusal_carries_sglangs_message(start_standin, monkeypatch) -> None:
    engine = start_standin()
    body = generation.generate_body(PROMPT, SamplingParams(n=2, top_k=0, seed=3, stop_token_ids=[5]))
    assert body["return_logprob"] is True and body["input_ids"] == [PROMPT, PROMPT]
    assert [sp["top_k"] for sp in body["sampling_params"]] == [-1, -1]          # SGLang's "off"
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [3, 4]
    bad = {**body, "sampling_params": [{**sp, "top_k": 0} for sp in body["sampling_params"]]}
    r = requests.post(engine.url + "/generate", json=bad, timeout=30)
    assert r.status_code == 400
    monkeypatch.setattr(generation, "generate_body", lambda p, s: bad)
    with pytest.raises(EngineError, match=r"SGLang refused POST /generate: top_k must be -1 "
                                          r"\(disable\) or at least 1, got 0\."):
        _sampler(engine).generate(PROMPT, SamplingParams(n=2), Gate())


def test_version_gate_and_tags_after_a_reload(start_standin, model_dir) -> None:
    engine = start_standin()
    a = _sampler(engine)
    a.adapter.load_from_disk(str(model_dir), 3)
    assert a.weight_version() == 3
    (s,) = a.generate(PROMPT, SamplingParams(max_new_tokens=3), Gate(exact_version=3))
    assert (s.version, s.version_end) == (3, 3) and not s.mixed
    with pytest.raises(NotFitting, match="holds version 3; the request wants version >= 4") as e:
        a.generate(PROMPT, SamplingParams(), Gate(min_version=4))
    assert e.value.held == 3


@pytest.mark.parametrize("mode", ["in_place_stale_kv", "abort"])
def test_a_swap_during_the_request_is_never_one_version(start_standin, model_sd, mode: str) -> None:
    """in_place_stale_kv: the request goes on with the new weights and comes back mixed (0 -> 1); abort:
    SGLang ends it, and the adapter refuses the partial samples (NotFitting)."""
    engine = start_standin(step_seconds=0.05)
    a = _sampler(engine)
    out: dict = {}

    def run() -> None:
        try:
            out["samples"] = a.generate(PROMPT, SamplingParams(max_new_tokens=60), Gate())
        except NotFitting as e:
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while engine.state()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    cfg = {"adapter": "sglang", "transport": "sglang_tensor", "engines": [engine.spec()],
           "sync": {"pause_mode": mode}}
    with WeightSync.from_config(cfg) as sync:
        assert sync.push(perturb(model_sd, 1), version=1).ok
    t.join(60)
    assert not t.is_alive()
    if mode == "in_place_stale_kv":
        (s,) = out["samples"]
        assert (s.version, s.version_end) == (0, 1) and s.mixed and len(s.token_ids) == 60
    else:
        # held: what the engine said right after the abort (the swap may not have landed yet)
        assert "aborted the request" in str(out["error"]) and out["error"].held in (0, 1)


def test_body_validates_as_sglangs_own_sampling_params(sglang_runner, tmp_path) -> None:
    """SGLang 0.5.23's own SamplingParams takes every value the adapter sends (greedy, filters off,
    per-sample seeds, stop ids) and GenerateReqInput knows every key of the body."""
    import json
    body = generation.generate_body(PROMPT, SamplingParams(n=2, top_p=0.9, seed=7, stop_token_ids=[5]))
    greedy = generation.generate_body(PROMPT, SamplingParams(temperature=0, top_k=3))
    body["sampling_params"] += greedy["sampling_params"]
    (tmp_path / "body.json").write_text(json.dumps(body))
    r = sglang_runner(HERE / "sglang_checks" / "check_generate.py", str(tmp_path / "body.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["unknown_body_keys"] == [] and out["unknown_sampling_keys"] == []
    first, second, g = out["parsed"]
    assert (first["top_k"], first["top_p"], first["sampling_seed"], first["stop_token_ids"]) == \
        (out["top_k_all"], 0.9, 7, [5])
    assert second["sampling_seed"] == 8
    assert (g["top_k"], g["temperature"]) == (1, 1.0)          # SGLang's greedy: top_k 1 at T 1
