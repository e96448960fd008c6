"""CUDA paths, run by `make test-gpu` on a machine with a GPU (skipped elsewhere):
- a CUDA state dict pushed over `shm` (CUDA IPC) into reference engines in other processes that
  open the handles, one holding its weights on the GPU and one on the CPU, bit-exact;
- the exporter and `cast` on CUDA tensors, packed into a CUDA buffer;
- hashing a CUDA bucket on the device (mlh), equal to the same bytes hashed on the CPU, with no
  device-to-host copy of the bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weightsync import WeightSync
from weightsync.wire.bucket import Bucket, digest_tensors
from weightsync.encodings.cast import CastEncoding
from weightsync.exporters.torch import TorchExporter
from weightsync.wire.mlh import _triton, chunk_sums
from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync_reference.processes import start_all
from weightsync.testing.sample import perturb
from weightsync_reference.processes import EngineProcess

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("engine_device", ["cuda", "cpu"])
def test_cuda_state_dict_over_cuda_ipc_bit_exact(tmp_path: Path, engine_device: str) -> None:
    sd = sample_state_dict(scale=8)
    eng = EngineProcess(write_weights_only_model(tmp_path / "m", sd), device=engine_device,
                        log=tmp_path / "engine.log").start(timeout=120)
    cfg = {"transport": {"kind": "shm", "options": {"device": "cuda"}}, "engines": [eng.spec()],
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 20000}},
           "sync": {"progress": "off"}}
    try:
        with WeightSync.from_config(cfg) as sync:
            for v in (1, 2, 3):
                sd = perturb(sd, v)
                report = sync.push({k: t.cuda() for k, t in sd.items()}, version=v)
                assert report.ok and report.verified, report.summary()
                assert report.buckets > 3
                assert all(d.startswith("mlh:") for d in report.digests.values())
                got = eng.weights()
                assert set(got) == set(sd)
                assert all(torch.equal(got[n], t) for n, t in sd.items()), v
                assert eng.health()["version"] == v
    finally:
        eng.stop()


def test_exporter_and_cast_on_cuda_tensors() -> None:
    sd = {k: t.cuda() for k, t in sample_state_dict(scale=4).items()}
    buckets = list(TorchExporter(TorchExporter.Options(bucket_bytes=4096)).buckets(sd))
    assert [n for b in buckets for n in b.names] == list(sd)
    assert all(t.is_cuda for b in buckets for _, t in b.tensors)
    enc = CastEncoding(CastEncoding.Options(dtype="bfloat16"))
    for b in buckets:
        p = enc.encode(b, lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))
        assert p.body.is_cuda and p.digest.startswith("mlh:")
        decoded = dict(enc.decode(p, lambda n: None))
        for n, t in b.tensors:
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert decoded[n].is_cuda and torch.equal(decoded[n], want), n
        assert digest_tensors([(n, decoded[n]) for n in b.names]) == p.digest


def test_cuda_bucket_hashes_on_device_equal_to_host_without_copying_it() -> None:
    g = torch.Generator().manual_seed(3)
    host = [(f"w{i}", torch.randn(3 * 2**20 + 7 * i, generator=g).to(torch.bfloat16)) for i in range(4)]
    dev = [(n, t.cuda()) for n, t in host]
    bucket = Bucket(0, dev, last=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = bucket.digest()
        torch.cuda.synchronize()
    d2h = [e for e in prof.events() if "DtoH" in e.name]
    nbytes = sum(t.numel() * t.element_size() for _, t in dev)
    # only the per-chunk sums come back: 16 bytes per 4 MiB chunk per tensor
    assert len(d2h) <= len(dev), [e.name for e in d2h]
    assert nbytes > 2**24
    assert got.startswith("mlh:")
    assert got == digest_tensors(host, "mlh")                 # the host computes the same digest
    assert got != digest_tensors(host)                        # and xxh3 is a different algorithm
    flipped = dev[2][1].clone()
    flipped.view(torch.int16)[12345] ^= 1
    assert digest_tensors(dev[:2] + [(dev[2][0], flipped)] + dev[3:]) != got


def test_triton_and_torch_sums_agree_on_cuda() -> None:
    if _triton() is None:
        pytest.skip(reason="Triton is not installed")
    t = torch.randint(-2**31, 2**31 - 1, (5 * 2**20 + 3,), dtype=torch.int32, device="cuda")
    a = chunk_sums(t, use_triton=True)
    b = chunk_sums(t, use_triton=False)
    c = chunk_sums(t.cpu())
    assert all(torch.equal(x.cpu(), y.cpu()) and torch.equal(x.cpu(), z) for x, y, z in zip(a, b, c))


@pytest.mark.parametrize("shape,encoding", [("chain", None), ("tree", "cast")])
def test_a_relayed_push_lands_bit_exact_in_engines_on_cuda(tmp_path: Path, shape: str,
                                                           encoding: str | None) -> None:
    """Members that hold their weights on the GPU pass the trainer's one copy on piece by piece
    (the `http` transport's relay shapes) while the bytes still arrive: every member stages each
    bucket into CUDA memory and commits bit for bit, and each member past the first got its bytes
    from a member."""
    sd = sample_state_dict(scale=4)
    if encoding == "cast":       # engines hold bf16; the trainer pushes fp32 master weights
        sd = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in sd.items()}
    model = write_weights_only_model(tmp_path / "m", sd)
    engines = [EngineProcess(model, name=f"e{i}", device="cuda", log=tmp_path / f"e{i}.log")
               for i in range(4)]
    start_all(engines, timeout=120)
    cfg = {"adapter": "reference", "engines": [e.spec() for e in engines],
           "transport": {"kind": "http", "options": {"shape": shape, "degree": 2,
                                                      "piece_bytes": 1 << 16}},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 1 << 20}},
           "sync": {"progress": "off", "deadline": 60}}
    if encoding:
        cfg["encoding"] = {"kind": encoding, "options": {"dtype": "bfloat16"}}
    try:
        with WeightSync.from_config(cfg) as sync:
            for v in (1, 2):
                sd = perturb(sd, v)
                sent = {k: (t.float() if encoding and t.is_floating_point() else t).cuda()
                        for k, t in sd.items()}
                report = sync.push(sent, version=v)
                assert report.ok and report.verified, report.summary()
                assert sync.transport.relay_events == [], sync.transport.relay_events
                for e in engines:
                    got = e.weights()
                    assert e.health()["version"] == v, e.name
                    assert all(torch.equal(got[n], t) for n, t in sd.items()), (e.name, v)
        relay = {e.name: e.health()["relay"] for e in engines}
        assert sum(r["forwarded"] for r in relay.values()) == 2 * report.buckets * 3, relay
        # every member got every bucket from the tree; a store on the GPU stages a bucket once it
        # is whole (one copy to the device before commit), so nothing is staged mid-stream
        assert all(r["received"] == 2 * report.buckets and r["streamed"] == 0
                   for r in relay.values()), relay
    finally:
        for e in engines:
            e.stop()
