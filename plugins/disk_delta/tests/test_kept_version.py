"""The sender's kept version: committed changes reach it (written in the background after commit),
a rolled-back sync leaves it as it was, and the next delta is made against exactly it."""

from __future__ import annotations

import os

import numpy as np
import torch

from weightsync.wire.bucket import Bucket
from weightsync_disk_delta.encoding import DeltaEncoding, decode_payload


def _step(sd: dict[str, torch.Tensor], seed: int, every: int = 50) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        t = t.clone()
        flat = t.view(-1)
        start = int(torch.randint(0, every, (1,), generator=g))
        flat[start::every] += torch.randn(flat[start::every].shape, generator=g).to(t.dtype)
        out[n] = t
    return out


def _sync(enc: DeltaEncoding, sd: dict[str, torch.Tensor], version: int, commit: bool = True):
    enc.begin(version)
    payload = enc.encode(Bucket(0, list(sd.items()), last=True))
    if commit:
        enc.commit(version)
    else:
        enc.rollback()
    return payload


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_kept_version_follows_commits_and_ignores_rollbacks() -> None:
    v1 = {f"l{i}": torch.randn(300, 257).to(torch.bfloat16) for i in range(6)}
    enc = DeltaEncoding()
    _sync(enc, v1, 1)
    assert _equal(enc.kept(), v1)
    v2 = _step(v1, 2)
    p2 = _sync(enc, v2, 2)
    assert p2.meta["kind"] == "delta" and {e["kind"] for e in p2.meta["tensors"].values()} == {"sparse"}
    assert enc.settle() > 0 and enc.settle() == 0.0   # the patch ran in the background, once
    assert _equal(enc.kept(), v2)
    v3 = _step(v2, 3)
    _sync(enc, v3, 3, commit=False)                 # the engines never got version 3
    assert _equal(enc.kept(), v2)
    v4 = _step(v3, 4)
    p4 = _sync(enc, v4, 4)
    assert p4.meta["base_version"] == 2
    specs = [(s.name, s.dtype, list(s.shape)) for s in p4.specs]
    out = dict(decode_payload(p4.meta, p4.body, specs, lambda n: v2[n], 2))
    assert _equal(out, v4)
    # a sync right after a commit waits for the kept version, so back-to-back syncs stay exact
    v5 = _step(v4, 5)
    p5 = _sync(enc, v5, 5)
    v6 = _step(v5, 6)
    p6 = _sync(enc, v6, 6)
    got5 = dict(decode_payload(p5.meta, p5.body, specs, lambda n: v4[n], 4))
    got6 = dict(decode_payload(p6.meta, p6.body, specs, lambda n: got5[n], 5))
    assert _equal(got6, v6) and _equal(enc.kept(), v6)


def test_a_forked_child_sees_a_whole_kept_version() -> None:
    v1 = {f"l{i}": torch.randn(2048, 2048).to(torch.bfloat16) for i in range(8)}
    enc = DeltaEncoding()
    _sync(enc, v1, 1)
    v2 = _step(v1, 2, every=7)
    _sync(enc, v2, 2)                               # its patch is being written now
    want = {n: t.view(torch.uint8).numpy() for n, t in v2.items()}
    pid = os.fork()
    if pid == 0:           # the child checks without waiting itself (numpy: torch's pool is the parent's)
        kept = enc._base or {}
        ok = all(np.array_equal(kept[n].view(torch.uint8).numpy(), w) for n, w in want.items())
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_receiver_at_another_version_refuses_the_delta() -> None:
    """The refusal the wrong-base push relies on, at the receiver: a delta made against version
    1 is not applied to an engine at version 0, and says why."""
    import pytest
    from weightsync.errors import PayloadError
    v1 = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    enc = DeltaEncoding()
    _sync(enc, v1, 1)
    p2 = _sync(enc, _step(v1, 2), 2)
    specs = [(s.name, s.dtype, list(s.shape)) for s in p2.specs]
    with pytest.raises(PayloadError, match="made against version 1, but the engine holds version 0"):
        decode_payload(p2.meta, p2.body, specs, lambda n: v1[n], 0)
