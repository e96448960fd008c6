"""shm buffer generations: a receiver may hash what it reads (not its copy) only because a buffer
the sender rewrote while it was read is refused, before staging or after it, never staged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync.receive import staging as rxmod
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import PayloadError
from weightsync.receive import DictStore, ReceiveSession
from weightsync.transports.shm import ShmReceiver, ShmTransport


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 33, generator=g).to(torch.bfloat16), "b": torch.randn(100, generator=g)}


def _announce(tr: ShmTransport, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What `ShmTransport.send` tells an engine, without an engine."""
    p = RawEncoding().encode(Bucket(0, named, last=True), alloc=tr.alloc)
    seg = tr._segment_of(p.body)
    return p.header(offset=p.body.data_ptr() - seg.tensor.data_ptr(), nbytes=p.body.numel(),
                    device="cpu", segment=seg.name, generation=seg.generation)


def test_a_reused_buffer_is_refused_before_and_after_the_copy() -> None:
    tr = ShmTransport(ShmTransport.Options(device="cpu", segments=1))
    rx = ShmReceiver(ShmTransport.Options())
    try:
        header = _announce(tr, list(_tensors().items()))
        assert header["transport"]["generation"] == 1 and rx.hash_source(header)
        view = rx.receive(header, None)
        assert view.numel() == header["nbytes"]
        rx.unchanged(header)                          # nothing happened: fine
        tr.segs[0].free.set()
        tr.alloc(16)                                  # the sender takes the buffer again
        with pytest.raises(PayloadError, match="rewrote"):
            rx.unchanged(header)
        with pytest.raises(PayloadError, match="already reused"):
            rx.receive(header, None)
        old = {**header, "transport": {k: v for k, v in header["transport"].items() if k != "generation"}}
        assert not rx.hash_source(old)                # a sender without generations: hash the copy
    finally:
        tr.close()


def test_a_buffer_rewritten_while_staged_is_never_staged(components: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    live = _tensors()
    tr = ShmTransport(ShmTransport.Options(device="cpu", segments=1))
    try:
        header = _announce(tr, [(n, t + 1) for n, t in live.items()])
        plan = {"version": 1, "transport": {"kind": "shm"}, "encoding": {"kind": "raw"}}
        s = ReceiveSession(DictStore({n: t.clone() for n, t in live.items()}), plan, components)
        real = rxmod.stage_digest
        private: list[bool] = []

        def racing(named: Any, buffer: Any, algo: str, priv: bool = False) -> Any:
            private.append(priv)
            out = real(named, buffer, algo, priv)
            tr.segs[0].free.set()
            tr.alloc(16)                              # a (buggy) sender rewrites it meanwhile
            return out
        monkeypatch.setattr(rxmod, "stage_digest", racing)
        with pytest.raises(PayloadError, match="rewrote"):
            s.apply(header, None)
        assert private == [True] and s.staged == {} and s.digests == {}
    finally:
        tr.close()
