"""Rollouts for RL against reference engines in their own processes: samples with logprobs and
version tags, spread over the fleet, one router URL, samples that span a swap, and the probe
that catches an engine computing with other weights than the bytes it verified."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import torch

from weightsync import WeightSync
from weightsync.errors import SyncError
from weightsync_rl.rollout import RolloutClient, RolloutRouter, SamplingParams, StaleEngines, Unsupported
from weightsync_rl.rollout.remote import RouterClient
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all
from weightsync_reference.models import build_tiny_model, load_trainer_model

HERE = Path(__file__).parent
SYNC = {"sync": {"progress": "off"}, "exporter": {"kind": "torch", "options": {"bucket_bytes": "64KiB"}}}

ROUTER_KEY = "router-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rl") / "m"
    build_tiny_model(d, "llama", vocab=128)
    return d


@pytest.fixture(scope="module")
def pair(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    logs = tmp_path_factory.mktemp("logs")
    engines = start_all([EngineProcess(model_dir, name=n, log=logs / f"{n}.log") for n in ("a", "b")])
    yield engines
    for e in engines:
        e.stop()


@torch.no_grad()
def _logprobs(model: torch.nn.Module, ids: list[int], temperature: float) -> list[float]:
    """The trainer's logprob of each next token under the temperature-scaled distribution."""
    x = torch.tensor([ids])
    lp = torch.log_softmax(model(input_ids=x).logits[0, :-1] / temperature, -1)
    return lp.gather(1, x[0, 1:, None])[:, 0].tolist()


def _perturbed(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_samples_carry_logprobs_versions_and_spread_over_the_fleet(model_dir: Path,
                                                                   pair: list[EngineProcess]) -> None:
    model = load_trainer_model(model_dir)
    with WeightSync.from_config({**SYNC, "engines": [e.spec() for e in pair]}) as sync:
        version = max(e.health()["version"] for e in pair) + 1
        _perturbed(model, version)
        report = sync.push(model, version=version)
        assert report.ok and report.verified, report.summary()
        assert all(o.probe is not None and o.probe["max"] < 1e-4 for o in report.engines.values())
        with RolloutClient([e.spec() for e in pair]) as client:
            prompts = [[1, 5, 9], [2, 4], [7, 7, 7, 7], [3]]
            params = SamplingParams(n=3, temperature=0.8, top_p=0.95, top_k=50, seed=5,
                                    max_new_tokens=6)
            samples = client.sample(prompts, params, exact_version=version)
            assert [s.prompt_index for s in samples] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
            assert {s.engine for s in samples} == {"a", "b"}
            for s in samples:
                assert s.version == s.version_end == version
                assert len(s.token_ids) == len(s.logprobs) == 6 and s.finish_reason == "length"
                mine = _logprobs(model, s.prompt_ids + s.token_ids, 0.8)[len(s.prompt_ids) - 1:]
                assert max(abs(a - b) for a, b in zip(mine, s.logprobs)) < 1e-4
            again = client.sample(prompts[:1], params, exact_version=version)
            assert [s.token_ids for s in again] == [s.token_ids for s in samples[:3]]
            # equal prompts in one call get seeds of their own (prompt j: seed + j * n), so a
            # GRPO batch that repeats a prompt does not repeat its samples; the call reproduces
            twice = [[4, 4]] * 2
            long = params.model_copy(update={"max_new_tokens": 24})
            first = client.sample(twice, long, exact_version=version)
            assert [s.token_ids for s in first[:3]] != [s.token_ids for s in first[3:]]
            assert [s.token_ids for s in client.sample(twice, long, exact_version=version)] == \
                [s.token_ids for s in first]
            shifted = client.sample([[4, 4]], long.model_copy(update={"seed": 5 + 3}),
                                    exact_version=version)
            assert [s.token_ids for s in shifted] == [s.token_ids for s in first[3:]]
            with pytest.raises(StaleEngines, match=rf"version >= {version + 1} .*'a': {version}"):
                client.sample([[1, 2]], params, min_version=version + 1, wait=0.5)


def test_a_parameter_an_engine_cannot_honour_is_refused(pair: list[EngineProcess]) -> None:
    """A sampler says which parameters its engine honours; the client refuses the others before
    anything is sent (the sampler registered through RL's hook, as an engine plugin does)."""
    from weightsync import hookimpl
    from weightsync.plugins import load_components
    from weightsync_reference.adapter import ReferenceAdapter
    from weightsync_reference.sampler import ReferenceSampler

    class GreedyOnly(ReferenceAdapter):
        name = "greedy-only"

    class GreedySampler(ReferenceSampler):
        sampling = frozenset({"max_new_tokens", "temperature"})

    class Plugin:
        @hookimpl
        def register_samplers(self, register):  # noqa: ANN001, ANN202
            register("greedy-only", GreedySampler)

    components = load_components()
    components.adapters.add(GreedyOnly)
    components.pm.register(Plugin(), name="greedy-only-sampler")
    with RolloutClient([{**pair[0].spec(), "adapter": "greedy-only"}], components=components) as c:
        assert c.sample([[1, 2]], {"temperature": 0.0, "max_new_tokens": 2})[0].token_ids
        with pytest.raises(Unsupported, match=r"cannot honour \['seed', 'top_p'\]"):
            c.sample([[1, 2]], {"seed": 1, "top_p": 0.5})


def test_the_router_serves_the_fleet_at_one_url(model_dir: Path, pair: list[EngineProcess],
                                                tmp_path: Path) -> None:
    third = EngineProcess(model_dir, name="c", log=tmp_path / "c.log").start(timeout=120)
    try:
        client = RolloutClient([e.spec() for e in pair] + [third.spec()], refresh=0.0)
        with RolloutRouter(client, api_key=ROUTER_KEY) as router:
            rc = RouterClient(router.url, api_key=ROUTER_KEY)
            out = rc.sample([[1, 2, 3]] * 6, {"n": 2, "max_new_tokens": 3, "seed": 1})
            assert len(out) == 12 and {s.engine for s in out} == {"a", "b", "c"}
            third.kill()                         # a member dies: the others serve
            out = rc.sample([[4, 5]] * 6, {"max_new_tokens": 2}, min_version=0)
            assert {s.engine for s in out} <= {"a", "b"} and len(out) == 6
            r = requests.post(router.url + "/generate", json={"input_ids": [1], "exact_version": 999,
                                                              "wait": 0.3}, timeout=30, headers=AUTH)
            assert r.status_code == 503
            body = r.json()
            assert "no member could serve version 999" in body["error"]
            assert set(body["held"]) == {"a", "b", "c"} and "c" in body["held"]
            r = requests.post(router.url + "/generate", json={"input_ids": [1], "sampling": {"top_p": 2}},
                              timeout=30, headers=AUTH)
            assert r.status_code == 400 and "top_p" in r.json()["error"]
    finally:
        third.stop()


def test_the_router_holds_against_callers(pair: list[EngineProcess]) -> None:
    """No key, no router (unless insecure on purpose); a caller without the key gets a 401; a
    request asking for more tokens than the budget is a 413 before any engine works; a token id
    outside the vocabulary is the engine's 400, passed on at once, and marks no engine down (the
    next caller is served at once)."""
    from weightsync.errors import ConfigError
    client = RolloutClient([e.spec() for e in pair], refresh=0.0)
    with pytest.raises(ConfigError, match="the router has no key"):
        RolloutRouter(client)
    with RolloutRouter(client, api_key=ROUTER_KEY, max_tokens=1000) as router:
        r = requests.post(router.url + "/generate", json={"input_ids": [1]}, timeout=30)
        assert r.status_code == 401
        big = {"prompts": [[1, 2]] * 10, "sampling": {"n": 4, "max_new_tokens": 100}}
        r = requests.post(router.url + "/generate", json=big, timeout=30, headers=AUTH)
        assert r.status_code == 413 and "asks for 4000 tokens" in r.json()["error"], r.text
        t0 = time.monotonic()
        r = requests.post(router.url + "/generate", timeout=60, headers=AUTH,
                          json={"input_ids": [1, 10**9], "wait": 20})
        assert r.status_code == 400 and "refused the request" in r.json()["error"], r.text
        assert time.monotonic() - t0 < 10            # not the whole `wait` (20 s)
        assert all(v is None or isinstance(v, int) for v in client.held().values())
        rc = RouterClient(router.url, api_key=ROUTER_KEY)
        assert len(rc.sample([[4, 5]] * 2, {"max_new_tokens": 2}, wait=5)) == 2


def _hold_after_first_tokens(url: str) -> None:
    """Arm a hold (a "keep" pause) that the engine takes itself between two decoding steps once
    5 more tokens exist: a push then lands inside that generation at a known token, whatever the
    machine's speed; the push's resume lets it go on."""
    requests.post(url + "/pause", json={"mode": "keep", "after_tokens": 5},
                  timeout=10).raise_for_status()


def _wait_held(url: str) -> None:
    from weightsync.testing.waiting import wait_for
    wait_for(lambda: requests.get(url + "/health", timeout=10).json()["paused"] == "keep", 120,
             "the engine holding the generation after its first tokens")


def _held_mid_generation(eng: EngineProcess, client: RolloutClient, params: SamplingParams,
                         got: dict[str, Any], key: str, **kw: Any) -> threading.Thread:
    """Start a generation and return once the engine holds it after its first tokens."""
    _hold_after_first_tokens(eng.url)
    th = threading.Thread(target=lambda: got.update({key: client.sample([[1, 2]], params, **kw)}))
    th.start()
    _wait_held(eng.url)
    return th


@pytest.mark.parametrize("pause_mode", ["keep", "keep_stale_kv"])
def test_a_sample_that_spans_a_swap_is_prefilled_again_with_the_new_weights(
        model_dir: Path, tmp_path: Path, pause_mode: str) -> None:
    """By default the engine drops the old weights' KV at a swap and prefills the sequence again:
    every token after the swap has the new version's logprob over the whole sequence (teacher
    forced), and each token says its version. `keep_stale_kv` (asked for by name) goes on over
    the old KV: those tokens match neither version, and the sample says so."""
    eng = EngineProcess(model_dir, name="s", log=tmp_path / "s.log").start(timeout=120)
    model = load_trainer_model(model_dir)
    try:
        cfg = {**SYNC, "engines": [eng.spec()], "sync": {"progress": "off", "pause_mode": pause_mode}}
        with WeightSync.from_config(cfg) as sync, RolloutClient([eng.spec()]) as client:
            long = SamplingParams(max_new_tokens=200, temperature=1.0, seed=2)
            got: dict[str, Any] = {}
            th = _held_mid_generation(eng, client, long, got, "s", mixed="keep")
            v0 = {name: t.clone() for name, t in model.state_dict().items()}
            _perturbed(model, 1)
            assert sync.push(model, version=1).ok
            th.join(300)
            (s,) = got["s"]
            assert (s.version, s.version_end) == (0, 1) and s.mixed and len(s.token_ids) == 200
            k = s.token_versions.index(1)
            assert k >= 5 and s.token_versions == [0] * k + [1] * (200 - k)
            new = _logprobs(model, [1, 2] + s.token_ids, 1.0)[1:]
            after = max(abs(a - b) for a, b in zip(s.logprobs[k:], new[k:]))
            model.load_state_dict(v0)
            old = _logprobs(model, [1, 2] + s.token_ids, 1.0)[1:]
            assert max(abs(a - b) for a, b in zip(s.logprobs[:k], old[:k])) < 1e-4
            info = requests.get(eng.url + "/info", timeout=10).json()
            if pause_mode == "keep":
                assert after < 1e-4 and not s.stale_kv and info["reprefills"] == 1
            else:           # the control: over the old KV the tokens are of neither version
                assert after > 1e-3 and s.stale_kv and info["reprefills"] == 0
    finally:
        eng.stop()


def test_a_client_refuses_a_sample_that_spans_a_swap_and_generates_it_again(
        model_dir: Path, tmp_path: Path) -> None:
    eng = EngineProcess(model_dir, name="s", log=tmp_path / "s.log").start(timeout=120)
    model = load_trainer_model(model_dir)
    try:
        with WeightSync.from_config({**SYNC, "engines": [eng.spec()], "sync": {"progress": "off",
                                                                                 "pause_mode": "keep"}}) as sync, \
                RolloutClient([eng.spec()]) as client:
            got: dict[str, Any] = {}
            th = _held_mid_generation(eng, client, SamplingParams(max_new_tokens=200, seed=2), got, "r")
            _perturbed(model, 2)
            assert sync.push(model, version=1).ok
            th.join(300)
            (r,) = got["r"]
            assert r.version == r.version_end == 1 and client.refused_mixed == 1
            assert r.token_versions == [1] * 200
    finally:
        eng.stop()


class _HoldSecondRollouts:
    """The loop's sampler, which arms a hold before the second call: the engine holds the next
    step's rollouts after their first tokens."""

    def __init__(self, sample: Any, url: str) -> None:
        self.sample, self.url, self.calls = sample, url, 0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            _hold_after_first_tokens(self.url)
        return self.sample(*a, **kw)


class _PushWhenHeld:
    """The loop's WeightSync, whose push of version 1 waits (bounded) for that hold: the swap
    surely lands inside the second rollouts' generation (the push's resume lets them go on)."""

    def __init__(self, sync: WeightSync, url: str) -> None:
        self.sync, self.url = sync, url

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)

    def push(self, *a: Any, **kw: Any) -> Any:
        if kw.get("version") == 1:
            _wait_held(self.url)
        return self.sync.push(*a, **kw)


@pytest.mark.parametrize("keep", [True, False])
def test_the_async_loop_trains_on_samples_that_span_the_swap_or_regenerates_them(
        model_dir: Path, tmp_path: Path, keep: bool) -> None:
    from weightsync_rl import CountingTask, RLLoop
    eng = EngineProcess(model_dir, name="s", log=tmp_path / "s.log").start(timeout=120)
    model = load_trainer_model(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        cfg = {**SYNC, "engines": [eng.spec()], "sync": {"progress": "off", "pause_mode": "keep"}}
        with WeightSync.from_config(cfg) as sync, RolloutClient([eng.spec()]) as client:
            loop = RLLoop(model, opt, _PushWhenHeld(sync, eng.url),
                          _HoldSecondRollouts(client.sample, eng.url),
                          CountingTask(seed=3), SamplingParams(n=2, max_new_tokens=1000, seed=3),
                          prompts_per_step=1, mode="async", epochs=1, keep_mixed=keep)
            first, second = list(loop.run(steps=2))
        assert first.push_ok and second.push_ok and loop.version == 2
        if keep:        # generated across the swap of version 1: kept, as old as version 0
            assert second.samples == 2 and second.mixed == 2 and second.dropped == 0
            assert second.staleness == 1.0 and client.refused_mixed == 0
            # prefilled again at the swap: each token measured under the version that sampled it
            assert set(second.gaps) == {"s@0", "s@1"} and second.gap_max < 1e-4
        else:           # refused and generated again, all at version 1
            assert second.samples == 2 and second.mixed == 0 and client.refused_mixed >= 1
            assert second.staleness == 0.0 and list(second.gaps) == ["s@1"]
    finally:
        eng.stop()


def _swap(a: str, b: str):  # noqa: ANN202
    def name_map(name: str, t: torch.Tensor):  # noqa: ANN202
        yield {a: b, b: a}.get(name, name), t
    return name_map


def test_the_probe_catches_swapped_tensors_and_weights_corrupted_after_commit(
        model_dir: Path, tmp_path: Path) -> None:
    """Both engines verify every digest (the bytes are the ones sent) and still compute with other
    weights; the probe fails them, and gated generation no longer counts them as holding it."""
    swapped = EngineProcess(model_dir, name="swapped", log=tmp_path / "w.log")
    faulty = EngineProcess(model_dir, name="faulty", log=tmp_path / "f.log",
                           program=[sys.executable, str(HERE / "faulty_engine.py")])
    start_all([swapped, faulty])
    model = load_trainer_model(model_dir)
    try:
        up0, up1 = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
        with WeightSync.from_config({**SYNC, "engines": [swapped.spec()]}) as sync:
            _perturbed(model, 1)
            with pytest.raises(SyncError, match="at probe: the engine's logprobs differ"):
                sync.push(model, version=1, name_map=_swap(up0, up1))
        with WeightSync.from_config({**SYNC, "engines": [faulty.spec()]}) as sync:
            with pytest.raises(SyncError) as e:
                sync.push(model, version=1)
            o = e.value.report.engines["faulty"]
            assert o.stage == "probe" and o.version == 1 and o.probe["max"] > 0.05
        for eng in (swapped, faulty):
            assert eng.health()["distrusted"]["version"] == 1
            with RolloutClient([eng.spec()]) as c, pytest.raises(StaleEngines, match="probe failed"):
                c.sample([[1, 2]], {"max_new_tokens": 2}, min_version=1, wait=0.5)
        # a later push that passes the probe is trusted again (the swapped engine, fixed map)
        with WeightSync.from_config({**SYNC, "engines": [swapped.spec()]}) as sync:
            _perturbed(model, 2)
            assert sync.push(model, version=2).ok
        with RolloutClient([swapped.spec()]) as c:
            assert c.sample([[1, 2]], {"max_new_tokens": 2}, min_version=2)[0].version == 2
    finally:
        swapped.stop()
        faulty.stop()
