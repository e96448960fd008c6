"""Transport `shm` with real processes and real POSIX shared memory; CUDA IPC handle logic on CPU."""

from __future__ import annotations

import base64
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from weightsync_reference.adapter import ReferenceAdapter
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.interfaces import Announce, Message
from weightsync.errors import PayloadError, TransportError
from weightsync.sync.pipeline import WeightSync
from weightsync_reference.contracts import TransportContract
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.transports.shm import cuda_ipc
from weightsync.transports.shm import SHM_DIR, ShmReceiver, ShmTransport

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory in /dev/shm")


def _segments(pid: int | None = None) -> list[str]:
    prefix = "weightsync-" if pid is None else f"weightsync-{pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


class TestShmContract(TransportContract):
    def make_transport(self, tmp_path: Path) -> ShmTransport:
        return ShmTransport(ShmTransport.Options(device="cpu"))


class _Reader(ReferenceAdapter):
    """An in-process engine half: each `Announce` it is delivered runs the real ShmReceiver on the
    real segment and holds the buffer until the test lets it go (that is what a slow engine does)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.seen: list[bytes] = []

    def deliver(self, message: Message) -> Mapping[str, Any]:
        assert isinstance(message, Announce), message
        buf = ShmReceiver(ShmTransport.Options()).receive(message.body, None)
        self.seen.append(bytes(buf.numpy()))
        assert self.gate.wait(30)
        return {}


def _payload(i: int, fill: int, alloc) -> Any:
    t = torch.full((1000,), fill, dtype=torch.int16)
    return RawEncoding().encode(Bucket(i, [(f"t{i}", t)], last=False), alloc)


def test_double_buffered_alloc_waits_for_release() -> None:
    tr = ShmTransport(ShmTransport.Options(device="cpu", timeout=20))
    eng = _Reader()
    try:
        tr.open([eng], 1)
        p0 = _payload(0, 1, tr.alloc)
        p1 = _payload(1, 2, tr.alloc)                 # the second buffer: no wait
        sent0, sent1 = bytes(p0.body.numpy()), bytes(p1.body.numpy())
        assert tr.send(p0, [eng]) == {}
        assert tr.send(p1, [eng]) == {}
        got: list[Any] = []
        th = threading.Thread(target=lambda: got.append(_payload(2, 3, tr.alloc)))
        th.start()
        th.join(0.5)
        assert th.is_alive(), "alloc handed out a buffer an engine was still reading"
        eng.gate.set()                                # the engine staged it: buffer released
        th.join(20)
        assert not th.is_alive() and got
        assert got[0].body.data_ptr() == p0.body.data_ptr()   # the same buffer, reused
        assert tr.finish([eng]) == {}
        # the engine read exactly buckets 0 and 1 (its two announces run concurrently, in any
        # order), not bucket 2's bytes written into the reused buffer
        assert sorted(eng.seen) == sorted([sent0, sent1])
        assert len(set(tr.segment_names())) == 2
    finally:
        eng.gate.set()
        tr.close()
    assert not [n for n in tr.segment_names()] and not _segments(os.getpid())


def test_alloc_times_out_with_clear_error() -> None:
    tr = ShmTransport(ShmTransport.Options(device="cpu", timeout=0.5, segments=1))
    eng = _Reader()
    try:
        tr.open([eng], 1)
        tr.send(_payload(0, 1, tr.alloc), [eng])
        with pytest.raises(TransportError, match="still being read by"):
            tr.alloc(10)
    finally:
        eng.gate.set()
        tr.close()


def test_receiver_rejects_foreign_names_and_bad_offsets() -> None:
    rx = ShmReceiver(ShmTransport.Options())
    with pytest.raises(PayloadError, match="not a weightsync segment"):
        rx.receive({"nbytes": 4, "transport": {"segment": "../etc/passwd", "offset": 0, "nbytes": 4}}, None)
    with pytest.raises(PayloadError, match="does not exist"):
        rx.receive({"nbytes": 4, "transport": {"segment": "weightsync-1-ab-1", "offset": 0, "nbytes": 4}}, None)
    tr = ShmTransport(ShmTransport.Options(device="cpu"))
    try:
        buf = tr.alloc(64)
        name = tr.segment_names()[0]
        with pytest.raises(PayloadError, match="exceeds segment"):
            rx.receive({"nbytes": 64, "transport": {"segment": name, "offset": 80, "nbytes": 64}}, None)
        buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        view = rx.receive({"nbytes": 4, "transport": {"segment": name, "offset": 0, "nbytes": 4}}, None)
        assert view.tolist() == [1, 2, 3, 4]
    finally:
        tr.close()


def test_segments_released_at_sync_end_when_asked(tmp_path: Path) -> None:
    model = write_weights_only_model(tmp_path / "m", sample_state_dict())
    with EngineProcess(model, log=tmp_path / "e.log") as e:
        cfg = {"transport": {"kind": "shm", "options": {"device": "cpu", "keep_segments": False}},
               "adapter": "reference", "engines": [e.spec()],
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
        with WeightSync.from_config(cfg) as sync:
            sd = perturb(sample_state_dict(), 1)
            assert sync.push(sd, version=1).verified
            assert _segments(os.getpid()) == []
            got = e.weights()
            assert all(torch.equal(got[n], t) for n, t in sd.items())


_SENDER = textwrap.dedent("""
    # A trainer process that is SIGKILLed in the middle of a sync.
    import sys, time
    import torch
    from weightsync.sync.pipeline import WeightSync
    from weightsync.testing.sample import sample_state_dict
    from weightsync.transports.shm import ShmTransport
    real = ShmTransport.send
    def slow_send(self, payload, engines):
        out = real(self, payload, engines)
        print("sending", payload.index, ",".join(self.segment_names()), flush=True)
        time.sleep(0.5)
        return out
    ShmTransport.send = slow_send
    cfg = {"transport": {"kind": "shm", "options": {"device": "cpu"}}, "adapter": "reference",
           "engines": [{"url": sys.argv[1], "name": "e"}],
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 2048}}, "sync": {"lease": 1.5}}
    sd = {k: (v + 1 if v.is_floating_point() else v) for k, v in sample_state_dict().items()}
    with WeightSync.from_config(cfg) as sync:
        sync.push(sd, version=1)
    print("finished", flush=True)
""")


def test_sender_killed_mid_sync_leaves_no_segments(tmp_path: Path) -> None:
    model = write_weights_only_model(tmp_path / "m", sample_state_dict())
    with EngineProcess(model, log=tmp_path / "e.log") as e:
        p = subprocess.Popen([sys.executable, "-c", _SENDER, e.url], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        try:
            line = p.stdout.readline().decode()
            assert line.startswith("sending 0"), line
            names = line.split()[2].split(",")
            assert names and all(n.startswith(f"weightsync-{p.pid}-") for n in names)
            p.stdout.readline()                       # second bucket: both buffers in use
            assert _segments(p.pid), "the sender should hold its segments while it runs"
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
        deadline = time.monotonic() + 20
        while _segments(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _segments(p.pid) == [], "segments of the killed sender leaked"
        assert e.health()["version"] == 0            # the half-done sync was never committed
        while e.health()["round"] is not None and time.monotonic() < deadline:
            time.sleep(0.1)                           # the dead trainer's round lease lapses
        assert e.health()["round"] is None
        # the engine takes the next trainer's sync as if nothing happened
        cfg = {"transport": {"kind": "shm", "options": {"device": "cpu"}}, "adapter": "reference",
               "engines": [e.spec()], "exporter": {"kind": "torch", "options": {"bucket_bytes": 2048}}}
        with WeightSync.from_config(cfg) as sync:
            sd = perturb(sample_state_dict(), 3)
            assert sync.push(sd, version=1).verified
        got = e.weights()
        assert all(torch.equal(got[n], t) for n, t in sd.items())


# -- CUDA IPC handles: the JSON logic, checked on CPU -------------------------------------------
_SHARE = (0, b"\x01" * 64, 4096, 0, b"/torch_123_456", 8, b"\x02" * 64, True)


def test_cuda_ipc_handle_is_json_and_round_trips() -> None:
    import json
    d = json.loads(json.dumps(cuda_ipc.share_tuple_to_json(_SHARE, 128, 1024)))
    args = cuda_ipc.rebuild_args(d)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    got = dict(zip(names, args))
    assert got["tensor_size"] == (1024,) and got["tensor_offset"] == 128 and got["dtype"] == torch.uint8
    assert got["storage_device"] == 0 and got["storage_handle"] == _SHARE[1]
    assert got["storage_size_bytes"] == 4096 and got["ref_counter_handle"] == _SHARE[4]
    assert got["ref_counter_offset"] == 8 and got["event_handle"] == _SHARE[6]
    assert got["event_sync_required"] is True and got["requires_grad"] is False


@pytest.mark.parametrize("field,value,msg", [
    ("kind", "pickle", "not a CUDA IPC handle"),
    ("handle", "%%%", "not valid base64"),
    ("device", -1, "non-negative integer"),
    ("numel", "12", "non-negative integer"),
    ("numel", 10_000, "exceeds the shared storage"),
])
def test_cuda_ipc_handle_rejects_bad_fields(field: str, value: Any, msg: str) -> None:
    d = cuda_ipc.share_tuple_to_json(_SHARE, 0, 1024)
    d[field] = value
    with pytest.raises(PayloadError, match=msg):
        cuda_ipc.rebuild_args(d)


def test_cuda_ipc_export_refuses_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ipc.export_buffer(torch.zeros(4, dtype=torch.uint8))
    assert base64.b64decode(cuda_ipc.share_tuple_to_json(_SHARE, 0, 1)["handle"]) == _SHARE[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_segments_announce_ipc_handles() -> None:
    tr = ShmTransport(ShmTransport.Options(device="cuda"))
    try:
        buf = tr.alloc(256)
        buf.fill_(7)
        assert tr.segs[0].ipc is not None and tr.segment_names() == []
    finally:
        tr.close()
