"""The reference engine and the pipeline on bad input: every error names the engine and tensor,
and nothing is half applied (weights and version unchanged)."""

import threading
import time

import pytest
import requests
import torch

from weightsync_reference import plugin as reference_plugin
from weightsync import SyncError, WeightSync, hookimpl
from weightsync.encodings.raw import RawEncoding
from weightsync.plugins import load_components, make_plugin_manager
from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync_reference.models import build_tiny_model, greedy
from weightsync.testing.sample import perturb
from weightsync.net.server import free_port
from weightsync_reference.processes import EngineProcess


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    with EngineProcess(write_weights_only_model(d / "m", sample_state_dict()),
                       log=d / "engine.log") as e:
        yield e


def cfg(*engines, **sync):
    return {"engines": [e.spec() if hasattr(e, "spec") else e for e in engines],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}},
            "sync": {"progress": "off", **sync}}


def assert_untouched(engine, version_before, weights_before):
    assert engine.health()["version"] == version_before
    after = engine.weights()
    for n, t in weights_before.items():
        assert torch.equal(after[n], t), f"{n} was half applied"


def test_unreachable_engine_is_named(engine):
    ghost = f"http://127.0.0.1:{free_port()}"
    with WeightSync.from_config(cfg({"url": ghost, "name": "ghost"})) as sync:
        with pytest.raises(SyncError) as e:
            sync.push(sample_state_dict(), version=1)
    msg = str(e.value)
    assert "ghost" in msg and "cannot connect" in msg and "is the engine running" in msg


def test_unknown_tensor_name_is_named_and_nothing_applied(engine):
    v0, w0 = engine.health()["version"], engine.weights()
    sd = perturb(sample_state_dict(), 1)
    sd["model.layers.0.mlp.up_projj.weight"] = sd.pop("model.layers.0.mlp.up_proj.weight")
    with WeightSync.from_config(cfg(engine)) as sync, pytest.raises(SyncError) as e:
        sync.push(sd, version=v0 + 1)
    msg = str(e.value)
    assert engine.name in msg and "'model.layers.0.mlp.up_projj.weight' is not in the engine's model" in msg
    assert "did you mean ['model.layers.0.mlp.up_proj.weight'" in msg
    assert_untouched(engine, v0, w0)


def test_shape_mismatch_is_named_and_nothing_applied(engine):
    v0, w0 = engine.health()["version"], engine.weights()
    sd = perturb(sample_state_dict(), 2)
    sd["model.norm.weight"] = torch.zeros(33)
    with WeightSync.from_config(cfg(engine)) as sync, pytest.raises(SyncError) as e:
        sync.push(sd, version=v0 + 1)
    assert "tensor 'model.norm.weight': shape [33] sent, engine has [32]" in str(e.value)
    assert_untouched(engine, v0, w0)


def test_dtype_mismatch_suggests_cast(engine):
    v0, w0 = engine.health()["version"], engine.weights()
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in perturb(sample_state_dict(), 3).items()}
    with WeightSync.from_config(cfg(engine)) as sync, pytest.raises(SyncError) as e:
        sync.push(sd, version=v0 + 1)
    assert "dtype float32 sent, engine has bfloat16; use encoding 'cast'" in str(e.value)
    assert_untouched(engine, v0, w0)


class FlippingRaw(RawEncoding):
    """Corrupts one byte after the digest is taken: a payload damaged in transit. Engines are
    told to decode with plain `raw`. The byte is flipped in place: the body is the transport's
    send buffer, and a copy would leave that buffer taken (the producer then waited for it
    until the payload timeout, 300 s, whenever it came round the ring before the push ended)."""
    name = "flipping_raw"

    @classmethod
    def describe(cls, options):
        return {"kind": "raw", "options": {}}

    def encode(self, bucket, alloc=None):
        p = super().encode(bucket, alloc)
        if p.index == 1:
            p.body[-3] ^= 0x10
        return p


class FlipPlugin:
    @hookimpl
    def register_encodings(self, register):
        register(FlippingRaw)


def test_corrupted_payload_is_detected_and_nothing_applied(engine):
    """The engine decodes with plain `raw` (the corruption happens on the wire side), finds a
    digest mismatch, and stays at its version with its old weights."""
    v0, w0 = engine.health()["version"], engine.weights()
    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(FlipPlugin())
    pm.register(reference_plugin, name="reference")
    comps = load_components(pm)
    with WeightSync.from_config({**cfg(engine), "encoding": "flipping_raw"}, components=comps) as sync:
        with pytest.raises(SyncError) as e:
            sync.push(perturb(sample_state_dict(), 4), version=v0 + 1)
    msg = str(e.value)
    assert engine.name in msg and "bucket 1" in msg and "corrupted in transit" in msg
    assert_untouched(engine, v0, w0)


def test_version_must_grow(engine):
    with WeightSync.from_config(cfg(engine)) as sync:
        v = engine.health()["version"] + 1
        assert sync.push(perturb(sample_state_dict(), 5), version=v).ok
        with pytest.raises(ValueError, match="not newer than the last pushed version"):
            sync.push(sample_state_dict(), version=v)
    with WeightSync.from_config(cfg(engine)) as sync, pytest.raises(SyncError, match="already at version"):
        sync.push(sample_state_dict(), version=v)


def test_api_key_is_required(tmp_path):
    with EngineProcess(write_weights_only_model(tmp_path / "m", sample_state_dict()), api_key="s3cret") as e:
        assert requests.post(e.url + "/pause", json={}, timeout=5).status_code == 401
        spec = {**e.spec(), "api_key": "wrong"}
        with WeightSync.from_config(cfg(spec)) as sync, pytest.raises(SyncError, match="API key"):
            sync.push(sample_state_dict(), version=1)
        with WeightSync.from_config(cfg(e)) as sync:
            assert sync.push(perturb(sample_state_dict(), 1), version=1).verified


@pytest.fixture(scope="module")
def lm_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    model = build_tiny_model(d / "model", "llama")
    with EngineProcess(d / "model", log=d / "engine.log") as e:
        yield e, model


def _generate_in_background(engine, n):
    box = {}
    t = threading.Thread(target=lambda: box.update(engine.generate([1, 5, 9], n)))
    t.start()
    time.sleep(0.3)
    return t, box


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_pause_modes_with_a_request_in_flight(lm_engine, mode):
    engine, model = lm_engine
    t, box = _generate_in_background(engine, 400)
    r = requests.post(engine.url + "/pause", json={"mode": mode}, timeout=5)
    assert r.status_code == 200
    time.sleep(0.3)
    if mode == "keep":
        assert t.is_alive(), "a kept request must wait while paused"
        requests.post(engine.url + "/resume", json={}, timeout=5)
        t.join(120)
        assert box["finish_reason"] == "length" and len(box["output_ids"]) == 400
    else:
        t.join(30)
        assert not t.is_alive(), "an aborted request must return, never hang"
        assert box["finish_reason"] == "abort" and len(box["output_ids"]) < 400
        requests.post(engine.url + "/resume", json={}, timeout=5)


def test_generation_follows_synced_weights(lm_engine):
    engine, model = lm_engine
    prompt = [1, 17, 42]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    v = engine.health()["version"] + 1
    with WeightSync.from_config(cfg(engine)) as sync:
        assert sync.push(model, version=v).verified
    out = engine.generate(prompt, 8)
    assert out["version"] == v and out["output_ids"] == greedy(model, prompt, 8)


def test_weights_only_engine_refuses_generate(engine):
    r = requests.post(engine.url + "/generate", json={"input_ids": [1]}, timeout=5)
    assert r.status_code == 409 and "weights-only" in r.json()["error"]


class _DropFirstResume:
    """A TCP proxy in front of a real engine that closes, unanswered, the first connection whose
    request is POST /resume: what a client sees when the engine drops an idle keep-alive socket
    just as it is reused."""

    def __init__(self, target_port: int) -> None:
        import socket
        self.target = target_port
        self.dropped = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client, socket), daemon=True).start()

    def _pipe(self, client, socket) -> None:
        upstream = None
        try:
            while True:
                data = client.recv(1 << 16)
                if not data:
                    return
                if data.startswith(b"POST /resume") and not self.dropped:
                    self.dropped += 1
                    return                                   # closed with no answer
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                    threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
                upstream.sendall(data)
        except OSError:
            return
        finally:
            client.close()

    @staticmethod
    def _back(upstream, client) -> None:
        try:
            while data := upstream.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()


def test_a_dropped_resume_connection_is_retried_and_the_engine_serves(engine):
    """Resume must never be lost: a paused engine serves no one."""
    port = int(engine.url.rsplit(":", 1)[1])
    proxy = _DropFirstResume(port)
    v0 = engine.health()["version"]
    spec = {**engine.spec(), "url": f"http://127.0.0.1:{proxy.port}"}
    with WeightSync.from_config(cfg(spec)) as sync:
        report = sync.push(perturb(sample_state_dict(), 7), version=v0 + 1)
    assert proxy.dropped == 1
    assert report.ok and report.version == v0 + 1
    h = engine.health()
    assert h["version"] == v0 + 1 and not h["paused"]
