"""Property-based fuzzing of the receiver: generated and mutated frames, headers and bodies are
fed to weightsync's receiving code (in process: thousands of cases; and over HTTP to a live
reference engine). After every case: nothing outside a clean refusal escaped (a refusal is what
the server answers with 400/409; anything else would be a 500), nothing was applied, and the
engine still takes a valid round and ends bit-exact. `WEIGHTSYNC_FUZZ_EXAMPLES` runs longer."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from weightsync.errors import PayloadError
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import WeightSyncError
from weightsync.plugins import load_components
from weightsync.receive import DictStore, ReceiveSession
from weightsync.wire.frame import frame, unframe

N = int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "1500"))
REFUSALS = (WeightSyncError, ValueError, KeyError, TypeError)
COMPONENTS = load_components()
PLAN = {"transport": {"kind": "http"}, "encoding": {"kind": "raw"}, "version": 1, "engine_version": 0}


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(16, generator=g),
            "c.step": torch.tensor([3, 4], dtype=torch.int64)}


LIVE = _live()
GOOD = RawEncoding().encode(Bucket(0, [(n, t + 1 if t.is_floating_point() else t)
                                       for n, t in LIVE.items()], last=True))
GOOD_FRAME = b"".join(bytes(p) for p in frame(GOOD.header(), GOOD.body))


def _fresh() -> tuple[DictStore, ReceiveSession]:
    store = DictStore({n: t.clone() for n, t in LIVE.items()})
    return store, ReceiveSession(store, PLAN, COMPONENTS)


def _apply(raw: bytes) -> tuple[DictStore, ReceiveSession, bool]:
    store, s = _fresh()
    try:
        header, body = unframe(raw)
        s.apply(header, body)
        return store, s, True
    except REFUSALS:
        return store, s, False


def _unchanged(store: DictStore) -> None:
    for n, t in LIVE.items():
        assert torch.equal(store.get(n), t), f"{n} changed without a commit"


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                           | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
HEADER_KEYS = ["index", "last", "encoding", "digest", "tensors", "nbytes", "meta", "sig", "version"]


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
@given(st.data())
def test_mutated_frames_are_refused_cleanly_and_apply_nothing(data: st.DataObject) -> None:
    raw = bytearray(GOOD_FRAME)
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "length", "field", "tensor", "body"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "insert":
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "length":                   # the u64 header length, anything up to 2^64-1
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    else:
        header, body = unframe(bytes(GOOD_FRAME))
        header = json.loads(json.dumps(header))
        body = bytearray(body)
        if kind == "field":
            key = data.draw(st.sampled_from(HEADER_KEYS + ["x"]))
            header[key] = data.draw(json_values)
        elif kind == "tensor":
            t = header["tensors"][data.draw(st.integers(0, len(header["tensors"]) - 1))]
            key = data.draw(st.sampled_from(["name", "dtype", "shape"]))
            t[key] = data.draw(json_values | st.sampled_from(
                ["../../etc/passwd", "a.weight", "float64", [2**62], [-1, 8], [8, 16, 1]]))
        else:                                # the safetensors body: its own header and offsets
            i = data.draw(st.integers(0, min(len(body), 400) - 1))
            body[i] = data.draw(st.integers(0, 255))
        raw = bytearray(b"".join(bytes(p) for p in frame(header, bytes(body))))
    store, session, ok = _apply(bytes(raw))
    _unchanged(store)                        # nothing is applied before commit, ever
    if ok and session.digests.get(0) != GOOD.digest:
        # the good bucket's bytes under another index (a header `index` mutated): staged, as a
        # bucket may arrive before its predecessors, and the round refused at its end
        assert list(session.digests.values()) == [GOOD.digest]
        with pytest.raises(PayloadError, match=r"buckets \[0(, \d+)*\] never arrived"):
            session.end()
    elif ok:                                 # accepted: then it staged exactly the good bucket
        assert bytes(raw) == GOOD_FRAME or session.digests.get(0) == GOOD.digest
    session.close()


@settings(max_examples=max(200, N // 5), deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True, database=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_cleanly(raw: bytes) -> None:
    store, session, ok = _apply(raw)
    assert not ok
    _unchanged(store)
    session.close()


def test_a_valid_round_still_lands_after_garbage() -> None:
    store, s = _fresh()
    for junk in (b"", b"\x00" * 8, GOOD_FRAME[:-1], GOOD_FRAME + b"x"):
        with pytest.raises(REFUSALS):
            header, body = unframe(junk)
            s.apply(header, body)
    header, body = unframe(GOOD_FRAME)
    s.apply(header, body)
    s.commit()
    want = {n: (t + 1 if t.is_floating_point() else t) for n, t in LIVE.items()}
    assert all(torch.equal(store.get(n), t) for n, t in want.items())


def test_over_http_a_live_engine_refuses_fuzzed_frames_and_keeps_its_version(tmp_path: Path) -> None:
    """The same mutations against a real engine process: every answer is a 4xx (never a 500, never
    a dropped connection), the engine stays at version 0 with its weights, then takes a round."""
    import random

    import requests

    from weightsync.testing import write_weights_only_model
    from weightsync_reference.processes import EngineProcess
    rng = random.Random(5)
    with EngineProcess(write_weights_only_model(tmp_path / "m", LIVE), log=tmp_path / "e.log") as eng:
        begin = requests.post(eng.url + "/weightsync/begin", json={**PLAN, "lease": 60}, timeout=10)
        rid = begin.json()["round"]
        statuses = set()
        for _ in range(max(100, N // 15)):
            raw = bytearray(GOOD_FRAME)
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            if rng.random() < 0.3:
                raw = raw[: rng.randrange(len(raw))]
            r = requests.post(eng.url + "/weightsync/payload", data=bytes(raw),
                              headers={"X-Weightsync-Round": rid}, timeout=30)
            statuses.add(r.status_code)
            assert r.status_code in (200, 400, 409, 413), (r.status_code, r.text[:200])
            if r.status_code == 200:       # a flip that left the frame valid (in padding)
                requests.post(eng.url + "/weightsync/abort", headers={"X-Weightsync-Round": rid})
                rid = requests.post(eng.url + "/weightsync/begin", json={**PLAN, "lease": 60},
                                    timeout=10).json()["round"]
        assert 400 in statuses and eng.health()["version"] == 0
        got = eng.weights()
        assert all(torch.equal(got[n], t) for n, t in LIVE.items())
        requests.post(eng.url + "/weightsync/abort", headers={"X-Weightsync-Round": rid})
        from weightsync import WeightSync
        with WeightSync.from_config({"engines": [eng.spec()], "sync": {"progress": "off"}}) as sync:
            want = {n: (t + 1 if t.is_floating_point() else t) for n, t in LIVE.items()}
            assert sync.push(want, version=1).verified
        got = eng.weights()
        assert all(torch.equal(got[n], t) for n, t in want.items())

