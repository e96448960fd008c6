"""Transport `collective` with real processes: reference engines join a gloo group over a TCP
store, the trainer broadcasts one bucket at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import ConfigError, SyncError
from weightsync.sync.pipeline import WeightSync
from weightsync_reference.contracts import TransportContract
from weightsync_reference.processes import EngineProcess, start_all
from weightsync.net.server import free_port
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.transports.collective import pg as pgs
from weightsync.transports.collective import CollectiveTransport, split_payload


class TestCollectiveContract(TransportContract):
    def make_transport(self, tmp_path: Path) -> CollectiveTransport:
        return CollectiveTransport(CollectiveTransport.Options(timeout=20))


def _payload():
    return RawEncoding().encode(Bucket(0, list(sample_state_dict().items()), last=True))


def test_split_safetensors_is_whole_body() -> None:
    p = _payload()
    [(t, dtype, specs)] = split_payload(p.body, "safetensors")
    assert t.data_ptr() == p.body.data_ptr() and t.numel() == p.body.numel() and dtype == "uint8"
    assert sorted(s["name"] for s in specs) == sorted(s.name for s in p.specs)


def test_split_flat_and_per_dtype_carry_exact_tensor_bytes() -> None:
    p = _payload()
    sd = sample_state_dict()
    [(flat, _, specs)] = split_payload(p.body, "flat")
    # wire order: itemsize descending, then dtype name
    sizes = [torch.empty((), dtype=sd[s["name"]].dtype).element_size() for s in specs]
    assert sizes == sorted(sizes, reverse=True)
    off = 0
    for s in specs:
        t = sd[s["name"]]
        n = t.numel() * t.element_size()
        assert torch.equal(flat[off: off + n].view(t.dtype).view(t.shape), t), s["name"]
        off += n
    assert off == flat.numel()
    runs = split_payload(p.body, "flat_per_dtype")
    assert [r[1] for r in runs] == ["int64", "float32", "bfloat16", "float16"]
    for t, dtype, specs in runs:
        assert str(t.dtype) == f"torch.{dtype}"
        off = 0
        for s in specs:
            want = sd[s["name"]].reshape(-1)
            assert torch.equal(t[off: off + want.numel()], want), s["name"]
            off += want.numel()
        assert off == t.numel()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_weights_only_model(tmp_path / "model", sample_state_dict())


def _config(engines: list[dict], **opts) -> dict:
    return {"transport": {"kind": "collective", "options": {"timeout": 15, **opts}},
            "adapter": "reference", "engines": engines,
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}},
            "sync": {"failure_policy": "continue"}}


def _assert_holds(engines: tuple[EngineProcess, ...], version: int, sd: dict[str, torch.Tensor]) -> None:
    """Every engine serves `version` and holds exactly `sd`."""
    for e in engines:
        assert e.health()["version"] == version
        got = e.weights()
        assert all(torch.equal(got[n], t) for n, t in sd.items()), e.name


def test_one_broadcast_per_bucket_and_group_rebuilt_when_engines_change(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = pgs.start_broadcast

    def counting(pg, tensor, timeout):
        calls.append(tensor.numel())
        return real(pg, tensor, timeout)

    monkeypatch.setattr(pgs, "start_broadcast", counting)
    a, b = start_all([EngineProcess(model_dir, log=tmp_path / "a.log"),
                      EngineProcess(model_dir, log=tmp_path / "b.log")])
    try:
        with WeightSync.from_config(_config([a.spec(), b.spec()])) as sync:
            sd = perturb(sample_state_dict(), 1)
            r = sync.push(sd, version=1)
            assert r.ok and r.verified, r.summary()
            assert len(calls) == r.buckets and r.buckets < len(sd)   # never one per tensor
            first = sync.transport.group.name
            sd = perturb(sd, 2)
            assert sync.push(sd, version=2).ok
            assert sync.transport.group.name == first                # same engines: same group
            b.stop()
            sd = perturb(sd, 3)
            r = sync.push(sd, version=3)
            assert not r.engines[b.name].ok and r.engines[a.name].ok
            b.start()
            sd = perturb(sd, 4)
            r = sync.push(sd, version=4)
            assert r.ok and r.verified, r.summary()
            assert sync.transport.group.name != first                # rebuilt for the new set
        _assert_holds((a, b), 4, sd)
    finally:
        a.stop()
        b.stop()


def test_buckets_are_announced_ahead_and_an_aborted_round_leaves_no_stale_announce(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bucket is announced when it is packed (while the one before it is broadcast); a
    round that fails after announcing buckets it never broadcasts leaves the engines waiting on
    a group that the next round replaces, and that round lands bit-exact."""
    taken: list[bool] = []
    real_take = CollectiveTransport._take_ahead

    def take(self, payload, engines):
        got = real_take(self, payload, engines)
        taken.append(got is not None)
        return got
    monkeypatch.setattr(CollectiveTransport, "_take_ahead", take)
    a, b = start_all([EngineProcess(model_dir, log=tmp_path / "a.log"),
                      EngineProcess(model_dir, log=tmp_path / "b.log")])
    try:
        with WeightSync.from_config(_config([a.spec(), b.spec()])) as sync:
            v1 = perturb(sample_state_dict(), 1)
            r = sync.push(v1, version=1)
            assert r.ok and r.verified, r.summary()
            assert taken == [True] * r.buckets and r.buckets > 3
            first = sync.transport.group.name
            from weightsync_reference.adapter import ReferenceAdapter
            seen: list[int] = []

            def observe(self, payload):        # the 2nd bucket is packed and announced, never sent
                seen.append(payload.index)
                if len(seen) == 3:
                    raise RuntimeError("trainer broke mid-round")
            monkeypatch.setattr(ReferenceAdapter, "observe", observe)
            try:
                assert not sync.push(perturb(v1, 2), version=2).ok
            except RuntimeError as e:
                assert "trainer broke mid-round" in str(e)
            monkeypatch.undo()
            assert [e.health()["version"] for e in (a, b)] == [1, 1]     # nothing half-applied
            v3 = perturb(v1, 3)
            r = sync.push(v3, version=3)
            assert r.ok and r.verified, r.summary()
            assert sync.transport.group.name != first       # the poisoned group was replaced
        _assert_holds((a, b), 3, v3)
    finally:
        a.stop()
        b.stop()


_SILENT = textwrap.dedent("""
    # A real engine process that accepts every call but never joins the group it is asked to.
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            self._ok({"status": "ok", "version": 0, "paused": None})
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/weightsync/deliver" and b'"collective.join"' in body:
                time.sleep(3600)
            self._ok({"ok": True})
        def _ok(self, body):
            raw = json.dumps(body).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(raw)))
            self.send_header("Content-Type", "application/json"); self.end_headers()
            self.wfile.write(raw)
    s = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H); s.daemon_threads = True
    print("up", flush=True); s.serve_forever()
""")


def test_receiver_that_never_joins_fails_within_timeout(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    silent = subprocess.Popen([sys.executable, "-c", _SILENT, str(port)], stdout=subprocess.PIPE)
    good = EngineProcess(model_dir, log=tmp_path / "good.log").start()
    try:
        assert silent.stdout.readline().strip() == b"up"
        cfg = _config([good.spec(), {"url": f"http://127.0.0.1:{port}", "name": "silent"}], timeout=3)
        t0 = time.monotonic()
        with WeightSync.from_config(cfg) as sync:
            r = sync.push(perturb(sample_state_dict(), 1), version=1)
        elapsed = time.monotonic() - t0
        assert not r.engines["silent"].ok and r.engines["silent"].stage == "open"
        assert "did not join collective group" in r.engines["silent"].error
        assert r.engines[good.name].ok and good.health()["version"] == 1   # only itself failed
        assert elapsed < 60, f"the sender hung for {elapsed:.0f}s"          # bounded, not a hang
    finally:
        silent.kill()
        silent.wait()
        good.stop()


def test_only_engine_never_joins_raises(tmp_path: Path) -> None:
    port = free_port()
    silent = subprocess.Popen([sys.executable, "-c", _SILENT, str(port)], stdout=subprocess.PIPE)
    try:
        assert silent.stdout.readline().strip() == b"up"
        cfg = _config([{"url": f"http://127.0.0.1:{port}", "name": "silent"}], timeout=2)
        with WeightSync.from_config(cfg) as sync, pytest.raises(SyncError, match="did not join"):
            sync.push(sample_state_dict(), version=1)
    finally:
        silent.kill()
        silent.wait()


def test_mixed_layouts_refused() -> None:
    from weightsync_reference.adapter import ReferenceAdapter

    class Flat(ReferenceAdapter):
        layout = "flat"

    with pytest.raises(ConfigError, match="share a broadcast layout"):
        CollectiveTransport().open([ReferenceAdapter(), Flat()], 1)


def test_engine_killed_mid_push_fails_only_itself(tmp_path: Path, model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = start_all([EngineProcess(model_dir, log=tmp_path / "a.log"),
                      EngineProcess(model_dir, log=tmp_path / "b.log")])
    real = pgs.start_broadcast
    n = [0]

    def killing(pg, tensor, timeout):
        n[0] += 1
        if n[0] == 3:
            b.kill()                 # SIGKILL between two broadcasts of one sync
        return real(pg, tensor, timeout)

    try:
        with WeightSync.from_config(_config([a.spec(), b.spec()])) as sync:
            sd = perturb(sample_state_dict(), 1)
            monkeypatch.setattr(pgs, "start_broadcast", killing)
            r = sync.push(sd, version=1)
            monkeypatch.setattr(pgs, "start_broadcast", real)
            assert r.engines[a.name].ok and not r.engines[b.name].ok, r.summary()
            assert a.health()["version"] == 1
            got = a.weights()
            assert all(torch.equal(got[k], t) for k, t in sd.items())
            b.start()
            sd = perturb(sd, 2)
            r = sync.push(sd, version=2)
            assert r.ok and r.verified, r.summary()
        for e in (a, b):
            assert e.health()["version"] == 2
            got = e.weights()
            assert all(torch.equal(got[k], t) for k, t in sd.items())
    finally:
        a.stop()
        b.stop()


def test_engine_restarted_between_syncs_rejoins_without_waiting_for_timeout(
        tmp_path: Path, model_dir: Path) -> None:
    """b restarts between two pushes under the same name: it is no longer in the group, its
    announce fails before it receives, the broadcast is abandoned at once, and the group is
    rebuilt (a 300 s timeout would show up as a hang)."""
    a, b = start_all([EngineProcess(model_dir, log=tmp_path / "a.log"),
                      EngineProcess(model_dir, log=tmp_path / "b.log")])
    try:
        with WeightSync.from_config(_config([a.spec(), b.spec()], timeout=300)) as sync:
            sd = perturb(sample_state_dict(), 1)
            assert sync.push(sd, version=1).verified
            b.kill()
            b.start()
            b_version = b.health()["version"]
            assert b_version == 0
            t0 = time.monotonic()
            sd = perturb(sd, 2)
            r = sync.push(sd, version=2)
            assert r.ok and r.verified, r.summary()
            assert time.monotonic() - t0 < 60
        for e in (a, b):
            got = e.weights()
            assert e.health()["version"] == 2 and all(torch.equal(got[k], t) for k, t in sd.items())
    finally:
        a.stop()
        b.stop()
