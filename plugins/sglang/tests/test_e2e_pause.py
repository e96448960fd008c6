"""Pause modes with a request in flight, against the SGLang stand-in (its /generate is a slow
token loop whose tokens record the weight version they were made with)."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from weightsync.config import EngineSpec
from weightsync.errors import EngineError
from weightsync.sync.pipeline import WeightSync
from weightsync.testing.sample import perturb
from weightsync_sglang.adapter import SGLangAdapter

N = 100


def _generate_in_background(url: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        r = requests.post(url + "/generate", json={"input_ids": [1, 2, 3],
                                                   "sampling_params": {"max_new_tokens": N}}, timeout=120)
        out.update(r.json())
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _wait_running(engine) -> None:
    deadline = time.monotonic() + 30
    while engine.state()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    time.sleep(0.2)    # a few tokens with the old weights


@pytest.mark.parametrize("mode", ["abort", "retract", "keep", "in_place_stale_kv"])
def test_pause_mode_with_request_in_flight(start_standin, model_sd, mode: str) -> None:
    engine = start_standin(step_seconds=0.05)
    cfg = {"adapter": "sglang", "transport": "sglang_tensor", "engines": [engine.spec()],
           "sync": {"pause_mode": mode}}
    t, out = _generate_in_background(engine.url)
    _wait_running(engine)
    with WeightSync.from_config(cfg) as sync:
        report = sync.push(perturb(model_sd, 1), version=1)
    assert report.ok and report.verified, report.summary()
    t.join(60)
    assert not t.is_alive()
    meta = out["meta_info"]
    versions = meta["standin_token_weight_versions"]
    if mode == "abort":
        # the request was aborted at the pause and came back with what it had
        assert meta["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < N
        assert set(versions) == {"default"}
    else:
        # the request survived the update and finished on the new weights
        assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == N
        assert versions[0] == "default" and versions[-1] == "1"
        # keep is SGLang's retract: the request's KV is recomputed with the new weights
        assert meta["standin_retractions"] == (0 if mode == "in_place_stale_kv" else 1)
    # every mode flushes at commit; SGLang refuses while a request runs in place (only asked for)
    assert engine.state()["flushes"] == (0 if mode == "in_place_stale_kv" else 1)
    assert engine.weight_version() == "1"


def test_per_engine_pause_mode_overrides_sync_setting(start_standin, model_sd) -> None:
    engine = start_standin(step_seconds=0.05)
    cfg = {"adapter": "sglang", "transport": "sglang_tensor",
           "engines": [engine.spec(pause_mode="retract")], "sync": {"pause_mode": "abort"}}
    t, out = _generate_in_background(engine.url)
    _wait_running(engine)
    with WeightSync.from_config(cfg) as sync:
        assert sync.push(perturb(model_sd, 1), version=1).ok
    t.join(60)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["standin_retractions"] == 1


def test_flush_refused_while_requests_run_is_raised(start_standin) -> None:
    engine = start_standin(step_seconds=0.05)
    a = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    t, _ = _generate_in_background(engine.url)
    _wait_running(engine)
    with pytest.raises(EngineError, match="SGLang refused POST /flush_cache: Flush cache failed"):
        a.flush_cache()
    t.join(60)
    a.flush_cache()
