"""The sync protocol against real reference-engine processes: engines that stage a round keep
generating during the transfer and pause only for the swap; rounds have ids and leases (a dead
trainer's round lapses and the engine serves its old version again); one live round per engine;
a push has a deadline; reports never say more than was checked.

The properties that hold for every transport and encoding (a push is applied and versioned; a
failed round leaves the engine at its old version) also run over a matrix of combinations found
through the plugin registry (`COMBOS`): core's http/raw against the reference engine, the
disk_delta plugin's `delta` over http against the reference engine, and the SGLang plugin's
`sglang_tensor` route against its stand-in (SGLang loads as it receives, so it is paused for the
whole push). A combination whose plugin is not installed is skipped with that reason."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests
import torch

from weightsync_reference import plugin as reference_plugin
from weightsync import SyncError, WeightSync
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all
from weightsync_reference.models import build_tiny_model, greedy
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("protocol") / "model"
    build_tiny_model(d, "llama", hidden=64, intermediate=256, layers=4)
    return d


def slow(sd: dict[str, torch.Tensor], pause: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A trainer whose export takes time (an FSDP gather, say): the round stays open meanwhile."""
    for n, t in sd.items():
        time.sleep(pause)
        yield n, t


def cfg(engines: list[EngineProcess], transport: str = "http", **sync: Any) -> dict[str, Any]:
    return HTTP_RAW.config([e.spec() for e in engines], transport=transport, **sync)


ROOT = Path(__file__).resolve().parents[1]
SGLANG_STANDIN = ROOT / "plugins" / "sglang" / "tests" / "standin" / "sglang_standin.py"


@dataclass(frozen=True)
class Combo:
    """One transport + encoding + adapter the protocol properties run over; `needs` names the
    registry entries (kind, name) it takes, so it is skipped when their plugin is missing."""

    id: str
    transport: str = "http"
    encoding: str | None = None                  # None: the default (raw)
    adapter: str = "reference"
    engine: str = "reference"                    # "reference": EngineProcess; "sglang": its stand-in
    needs: tuple[tuple[str, str], ...] = ()
    stages: bool = True                          # False: the engine loads as it receives
    pause: str = "swap"

    def config(self, engines: list[dict[str, Any]], *, transport: str | None = None,
               base: Path | None = None, **sync: Any) -> dict[str, Any]:
        bucket = 256 * 1024 if self.encoding == "delta" else 16 * 1024   # delta: per-bucket cost
        c: dict[str, Any] = {"transport": transport or self.transport, "engines": engines,
                             "exporter": {"kind": "torch", "options": {"bucket_bytes": bucket}},
                             "sync": {"progress": "off", **sync}}
        if self.adapter != "reference":
            c["adapter"] = self.adapter
        if self.encoding == "delta":
            c["encoding"] = {"kind": "delta", "options": {"base_checkpoint": str(base)}}
        elif self.encoding is not None:
            c["encoding"] = self.encoding
        return c


HTTP_RAW = Combo("http-raw")
COMBOS = [HTTP_RAW,
          Combo("http-delta", encoding="delta", needs=(("encoding", "delta"),)),
          Combo("sglang_tensor-standin", transport="sglang_tensor", adapter="sglang", engine="sglang",
                needs=(("transport", "sglang_tensor"), ("adapter", "sglang")), stages=False,
                pause="sync")]


@dataclass
class Served:
    """One engine of a combination, shared by the module's tests: its spec, how to read its
    version and weights, and the weights it should hold now."""

    combo: Combo
    spec: dict[str, Any]
    version: Callable[[], int]
    weights: Callable[[], dict[str, torch.Tensor]]
    base: Path
    holds: dict[str, torch.Tensor]


def _start_standin(model: Path, log: Path) -> tuple[str, Callable[[], None]]:
    """The SGLang stand-in (SGLang itself cannot run here) as a process; its url and stop."""
    from weightsync.net.server import free_port
    port = free_port()
    out = open(log, "ab")
    proc = subprocess.Popen([sys.executable, str(SGLANG_STANDIN), "--model", str(model),
                             "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return url, stop
        except requests.RequestException:
            pass
        time.sleep(0.1)
    stop()
    raise RuntimeError(f"the SGLang stand-in did not answer /health within 120 s; see {log}")


@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: c.id)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    combo: Combo = request.param
    from weightsync.config import EngineSpec
    from weightsync.plugins import load_components, make_plugin_manager
    components = load_components(make_plugin_manager())
    for kind, name in combo.needs:
        if name not in getattr(components, kind + "s"):
            pytest.skip(reason=f"{combo.id}: no {kind} {name!r} is registered (its plugin is not installed)")
    if combo.engine == "sglang" and not SGLANG_STANDIN.exists():
        pytest.skip(reason=f"{combo.id}: the SGLang stand-in is not in this checkout")
    d = tmp_path_factory.mktemp(combo.id)
    sd = sample_state_dict(scale=2)
    model = write_weights_only_model(d / "model", sd)
    if combo.engine == "reference":
        eng = EngineProcess(model, name=combo.id, log=d / "engine.log").start()
        url, stop, read = eng.url, eng.stop, eng.weights
    else:
        url, stop = _start_standin(model, d / "standin.log")

        def read() -> dict[str, torch.Tensor]:
            from safetensors.torch import load
            r = requests.get(url + "/standin/weights", timeout=30)
            r.raise_for_status()
            return load(r.content)
    spec = {"url": url, "name": combo.id}
    adapter_cls = components.adapters.get(combo.adapter)
    adapter = adapter_cls(adapter_cls.Options(), EngineSpec(**spec))
    try:
        yield Served(combo, spec, lambda: int(adapter.health().version or 0), read, model, sd)
    finally:
        stop()


def push_is_applied_and_versioned(s: Served, rounds: int = 2) -> None:
    """Pushes in a row: each reports ok, each moves the engine to its version, and the engine
    then holds exactly what was pushed."""
    with WeightSync.from_config(s.combo.config([s.spec], base=s.base, pause=s.combo.pause)) as sync:
        for _ in range(rounds):
            v = s.version() + 1
            new = perturb(s.holds, v)
            report = sync.push(new, version=v)
            assert report.ok, report.summary()
            assert report.engines[s.combo.id].version == v and s.version() == v
            got = s.weights()
            assert all(torch.equal(got[n], t) for n, t in new.items()), f"{s.combo.id}: version {v}"
            s.holds = new


def failed_round_keeps_the_old_version(s: Served) -> None:
    """A push the engine refuses (a tensor its model does not have) fails, and the engine stays at
    its old version; an engine that stages also keeps its old weights, bit for bit."""
    v = s.version()
    bad = {**perturb(s.holds, v + 1), "no.such.tensor": torch.zeros(3)}
    with WeightSync.from_config(s.combo.config([s.spec], base=s.base, pause=s.combo.pause)) as sync, \
            pytest.raises(SyncError) as err:
        sync.push(bad, version=v + 1)
    assert s.combo.id in str(err.value) and "no.such.tensor" in str(err.value), str(err.value)
    assert s.version() == v
    if s.combo.stages:
        got = s.weights()
        assert all(torch.equal(got[n], t) for n, t in s.holds.items()), s.combo.id
    push_is_applied_and_versioned(s, rounds=1)            # nothing half-done blocks the next push


def post(engine: EngineProcess, path: str, body: Any = None, rid: str | None = None) -> requests.Response:
    headers = {"X-Weightsync-Round": rid} if rid else {}
    return requests.post(engine.url + path, json=body or {}, headers=headers, timeout=30)


# -- 1. pause only around the swap ------------------------------------------------------------
@pytest.mark.parametrize("pause", ["swap", "sync"])
def test_generation_runs_during_the_transfer_and_pauses_only_for_the_swap(
        llama_dir: Path, tmp_path: Path, pause: str) -> None:
    from weightsync_reference.models import load_trainer_model
    model = load_trainer_model(llama_dir)
    with EngineProcess(llama_dir, log=tmp_path / "e.log") as eng:
        old = greedy(model, PROMPT, 4)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        new = greedy(model, PROMPT, 4)
        assert new != old
        seen: dict[str, Any] = {}

        def during() -> None:            # once the round is open: generate, watch the pause
            while (h := eng.health())["round"] is None:
                time.sleep(0.005)
            # `sync` opens the round (under its lease) first and pauses right after it: watch
            # for the pause while the round is open (bounded by the push itself)
            while pause == "sync" and h["paused"] is None and h["round"] is not None:
                time.sleep(0.005)
                h = eng.health()
            seen["paused_while_open"] = h["paused"]
            if pause == "swap":
                seen["out"] = eng.generate(PROMPT, 4)
            seen["after"] = eng.health()

        th = threading.Thread(target=during)
        th.start()
        with WeightSync.from_config(cfg([eng], pause=pause)) as sync:
            report = sync.push(slow(model.state_dict(), 0.02), version=1)
        th.join(30)
        assert report.ok and report.verified
        if pause == "swap":
            assert seen["paused_while_open"] is None          # generating while staging
            assert seen["out"]["output_ids"] == old and seen["out"]["finish_reason"] == "length"
            assert seen["out"]["weight_version"] == 0
            assert seen["after"]["round"] is not None          # it finished before the swap
            assert report.pause_window < report.seconds["total"] / 2
        else:
            assert seen["paused_while_open"] == "abort"        # the old way: paused throughout
            assert report.pause_window >= report.seconds["export"]
        after = eng.generate(PROMPT, 4)
        assert after["output_ids"] == new and after["weight_version"] == 1


# -- 1b. over every installed combination -------------------------------------------------------
def test_a_push_is_applied_and_versioned(served: Served) -> None:
    push_is_applied_and_versioned(served)


def test_a_failed_round_leaves_the_engine_at_its_old_version(served: Served) -> None:
    failed_round_keeps_the_old_version(served)


# -- 2. leases: a trainer SIGKILLed at random moments -----------------------------------------
_ZYGOTE = textwrap.dedent("""
    # Imports torch and weightsync once, then forks one trainer per line read: a trainer starts
    # in milliseconds and the test can SIGKILL it at any moment of its push.
    import os, sys, time
    import torch
    from weightsync import WeightSync
    from weightsync.testing.sample import perturb, sample_state_dict
    url, transport, pause = sys.argv[1], sys.argv[2], sys.argv[3]
    for line in sys.stdin:
        version = int(line)
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            os.waitpid(pid, 0)
            continue
        sd = perturb(sample_state_dict(scale=4), version)
        def slow():
            for n, t in sd.items():
                time.sleep(0.03)
                yield n, t
        opts = {"device": "cpu"} if transport == "shm" else {}
        cfg = {"transport": {"kind": transport, "options": opts}, "engines": [{"url": url, "name": "e"}],
               "sync": {"lease": 1.0, "pause": pause, "progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
        with WeightSync.from_config(cfg) as sync:
            sync.push(slow(), version=version)
        os._exit(0)
""")


@pytest.mark.parametrize("transport,pause", [("http", "swap"), ("shm", "sync")])
def test_a_killed_trainers_round_lapses_and_the_engine_serves_its_old_version(
        llama_dir: Path, tmp_path: Path, transport: str, pause: str) -> None:
    base = sample_state_dict(scale=4)
    states = {0: base}
    rng = random.Random(13)
    model = write_weights_only_model(tmp_path / "m", base)
    with EngineProcess(model, log=tmp_path / "e.log") as eng:
        committed = 0
        zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE, eng.url, transport, pause],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for trial in range(10):
                version = committed + 1
                states[version] = perturb(base, version)
                zygote.stdin.write(f"{version}\n")
                zygote.stdin.flush()
                pid = int(zygote.stdout.readline())
                time.sleep(rng.uniform(0.0, 1.2))            # the push takes about 1.5 s
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                while time.monotonic() - killed < 1.0 + 1.0:  # lease + 1 s
                    h = eng.health()
                    if h["round"] is None and h["paused"] is None:
                        break
                    time.sleep(0.02)
                h = eng.health()
                assert h["round"] is None and h["paused"] is None, f"trial {trial}: still {h}"
                assert h["version"] in (committed, version), h
                committed = h["version"]
                got = eng.weights()
                assert all(torch.equal(got[n], t) for n, t in states[committed].items()), trial
        finally:
            zygote.kill()
            zygote.wait(10)
        # the next trainer's push succeeds
        with WeightSync.from_config(cfg([eng], transport, lease=1.0)) as sync:
            sd = perturb(base, 99)
            assert sync.push(sd, version=committed + 1).verified
        got = eng.weights()
        assert all(torch.equal(got[n], t) for n, t in sd.items())


# -- 3. round ids ----------------------------------------------------------------------------
def test_one_live_round_ids_on_every_call_and_a_name_once_per_round(tmp_path: Path) -> None:
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), log=tmp_path / "e.log") as eng:
        plan = {"transport": {"kind": "http"}, "encoding": {"kind": "raw"}}
        r = post(eng, "/weightsync/begin", {**plan, "version": 1, "lease": 5})
        assert r.status_code == 200
        rid = r.json()["round"]
        r2 = post(eng, "/weightsync/begin", {**plan, "version": 2, "lease": 5})
        assert r2.status_code == 409
        msg = r2.json()["error"]
        assert f"round {rid} (version 1) is open" in msg and "version 2 is refused" in msg
        assert "lease expires in" in msg
        r3 = post(eng, "/weightsync/end", rid="someone-else")
        assert r3.status_code == 409
        assert "round someone-else is not the open round" in r3.json()["error"] and rid in r3.json()["error"]
        assert post(eng, "/weightsync/abort", rid="someone-else").status_code == 409
        assert eng.health()["round"]["id"] == rid             # a wrong id aborts nothing
        # the same tensor in two buckets of one round is refused
        from weightsync.encodings.raw import RawEncoding
        from weightsync.wire.bucket import Bucket
        from weightsync.wire.frame import frame
        name = "model.norm.weight"
        enc = RawEncoding()
        for index in (0, 1):
            p = enc.encode(Bucket(index, [(name, sd[name])], last=index == 1))
            parts = frame(p.header(), p.body)
            resp = requests.post(eng.url + "/weightsync/payload", data=b"".join(bytes(x) for x in parts),
                                 headers={"X-Weightsync-Round": rid}, timeout=30)
            if index == 0:
                assert resp.status_code == 200
            else:
                assert resp.status_code == 400
                assert f"tensor {name!r} was already sent in this round" in resp.json()["error"]
        assert post(eng, "/weightsync/abort", rid=rid).status_code == 200
        assert eng.health()["round"] is None and eng.health()["version"] == 0


def test_two_trainers_pushing_at_once_never_mix_their_weights(tmp_path: Path) -> None:
    base = sample_state_dict(scale=2)
    with EngineProcess(write_weights_only_model(tmp_path / "m", base), log=tmp_path / "e.log") as eng:
        states: dict[int, dict[str, torch.Tensor]] = {0: base}
        outcomes = {"committed": 0, "refused": 0}
        for trial in range(20):
            v = eng.health()["version"]
            pushes = {"A": v + 1, "B": v + 2}
            for who, ver in pushes.items():
                states[ver] = perturb(base, 1000 * trial + ver + (0 if who == "A" else 500))
            errors: dict[str, BaseException] = {}

            def run(who: str) -> None:
                try:
                    with WeightSync.from_config(cfg([eng], lease=5.0)) as sync:
                        sync.push(slow(states[pushes[who]], 0.002), version=pushes[who])
                except SyncError as e:
                    errors[who] = e
            threads = [threading.Thread(target=run, args=(w,)) for w in pushes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            h = eng.health()
            assert h["round"] is None
            got = eng.weights()
            assert all(torch.equal(got[n], t) for n, t in states[h["version"]].items()), (trial, h)
            outcomes["committed"] += 2 - len(errors)
            outcomes["refused"] += len(errors)
            for e in errors.values():
                assert "is open" in str(e) or "not newer" in str(e), e
        assert outcomes["refused"] > 0 and outcomes["committed"] >= 20


# -- 4. deadline -----------------------------------------------------------------------------
@pytest.mark.parametrize("transport,when", [("http", "before"), ("http", "during"), ("shm", "during")])
def test_a_hung_engine_is_dropped_within_the_deadline(tmp_path: Path, transport: str, when: str) -> None:
    sd = sample_state_dict(scale=4)
    model = write_weights_only_model(tmp_path / "m", sd)
    engines = start_all([EngineProcess(model, name=f"e{i}", log=tmp_path / f"e{i}.log") for i in range(3)])
    hung = engines[1]
    try:
        # the healthy engines get 6 s an answer (a loaded 2-core CI box needs seconds), the hung
        # one is dropped at that bound, well inside the push's deadline
        c = cfg(engines, transport, deadline=20.0, lease=3.0)
        if transport == "shm":
            c["transport"] = {"kind": "shm", "options": {"device": "cpu"}}
        for spec in c["engines"]:
            spec["options"] = {"timeout": 4.0, "payload_timeout": 6.0}
        new = perturb(sd, 1)

        def model_iter() -> Iterator[tuple[str, torch.Tensor]]:
            for i, (n, t) in enumerate(new.items()):
                if when == "during" and i == 5:
                    os.kill(hung.proc.pid, signal.SIGSTOP)
                    time.sleep(0.2)
                yield n, t
        if when == "before":
            os.kill(hung.proc.pid, signal.SIGSTOP)
        with WeightSync.from_config(c) as sync:
            t0 = time.monotonic()
            with pytest.raises(SyncError) as err:
                sync.push(model_iter(), version=1)
            took = time.monotonic() - t0
        report = err.value.report
        assert took < 20.0 + 1.0, took
        bad = report.engines["e1"]
        assert not bad.ok and bad.stage in ("health", "send") and bad.status == "failed"
        assert "e1" in str(err.value)
        for e in (engines[0], engines[2]):
            o = report.engines[e.name]
            assert o.ok and o.status == "verified" and o.version == 1 and o.seconds > 0
            h = e.health()
            assert h["version"] == 1 and h["paused"] is None and h["round"] is None
            got = e.weights()
            assert all(torch.equal(got[n], t) for n, t in new.items())
        assert report.versions() == {"e0": 1, "e1": None if bad.stage == "health" else 0, "e2": 1}
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
        for e in engines:
            e.stop()


# -- 5. one version across the fleet; commit failures --------------------------------------------
def test_an_engine_failing_at_commit_is_reported_with_the_version_it_holds(tmp_path: Path) -> None:
    from weightsync_reference.adapter import ReferenceAdapter
    from weightsync.hookspecs import hookimpl
    from weightsync.plugins import load_components, make_plugin_manager

    class RefusesCommit(ReferenceAdapter):
        name = "refuses_commit"

        def commit(self, version: int) -> None:
            self.abort()
            raise RuntimeError("the engine refused the commit")

    class Plugin:
        @hookimpl
        def register_adapters(self, register: Any) -> None:
            register(RefusesCommit)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="test-refuses-commit")
    pm.register(reference_plugin, name="reference")
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with EngineProcess(model, name="good", log=tmp_path / "a.log") as a, \
            EngineProcess(model, name="bad", log=tmp_path / "b.log") as b:
        c = cfg([a, b], failure_policy="continue")
        c["engines"][1]["adapter"] = {"kind": "refuses_commit"}
        with WeightSync.from_config(c, components=load_components(pm)) as sync:
            report = sync.push(perturb(sd, 1), version=1)
        assert not report.ok and report.versions() == {"good": 1, "bad": 0}
        o = report.engines["bad"]
        assert o.stage == "commit" and "refused the commit" in o.error and o.version == 0
        assert "bad failed at commit (holds version 0)" in report.summary()
        assert a.health()["version"] == 1 and b.health()["version"] == 0
        assert b.health()["paused"] is None
