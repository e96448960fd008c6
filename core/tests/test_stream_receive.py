"""Payload bodies read straight into staging (`ReceiveSession.apply_stream`, `receive.read_staged`)
and fetched in binary from the sender's body server (`weightsync.net.bodyserver`): the same staged
bytes and digests as the buffered path, every check before any tensor byte is read, and exactly
the body's bytes consumed even when a payload is refused."""

from __future__ import annotations

import io
from typing import Any

import pytest
import requests
import torch

from weightsync.net.bodyserver import BodyServer, fetch
from weightsync.wire.bucket import Bucket, digest_tensors
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import PayloadError, TransportError
from weightsync.receive import BodyReader, DictStore, ReceiveSession, read_exact, read_staged
from weightsync.wire.frame import frame, read_frame_header


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, 70, generator=g).to(torch.bfloat16),
            "b": torch.randn(33, generator=g),
            "c": torch.zeros(0, 5, dtype=torch.bfloat16),
            "d": torch.randint(0, 100, (1000,), generator=g)}


def _session(components: Any, store: DictStore, version: int = 1) -> ReceiveSession:
    plan = {"version": version, "transport": {"kind": "http"}, "encoding": {"kind": "raw"}}
    return ReceiveSession(store, plan, components)


def _payload(named: list[tuple[str, torch.Tensor]], index: int = 0, last: bool = True) -> Any:
    return RawEncoding().encode(Bucket(index, named, last=last))


class Stream(io.BytesIO):
    """A request body that arrives in small pieces (as a socket's would), counting reads."""

    def __init__(self, data: bytes, piece: int = 1000) -> None:
        super().__init__(data)
        self.piece = piece

    def readinto(self, b: Any) -> int:
        view = memoryview(b)
        return super().readinto(view[: self.piece])


def _frame_bytes(p: Any) -> bytes:
    return b"".join(bytes(x) for x in frame(p.header(), p.body))


def test_streamed_payload_stages_the_same_bytes_and_digest(components: Any) -> None:
    live = _live()
    new = {n: (t + 1 if t.is_floating_point() else t * 2) for n, t in live.items()}
    p = _payload(list(new.items()))
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    assert s.streams(p.header())
    stream = Stream(_frame_bytes(p), piece=777)
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()))
    assert rest == p.body.numel() and header["digest"] == p.digest
    got = s.apply_stream(header, stream.readinto, rest)
    assert got == p.digest == digest_tensors(list(new.items()))
    assert stream.read() == b""                                   # exactly the body was read
    assert s.end() == {0: got}
    s.commit()
    assert all(torch.equal(s.store.get(n), t) for n, t in new.items())


def test_a_streamed_refusal_consumes_the_body(components: Any) -> None:
    live = _live()
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    bad = _payload([("a", torch.zeros(300, 71, dtype=torch.bfloat16))])      # wrong shape
    tail = b"NEXT REQUEST"
    stream = Stream(_frame_bytes(bad) + tail)
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()) - len(tail))
    with pytest.raises(PayloadError, match=r"\[300, 71\]"):
        s.apply_stream(header, stream.readinto, rest)
    assert stream.read() == tail
    corrupt = _payload([("b", torch.ones(33))], index=1)
    raw = bytearray(_frame_bytes(corrupt))
    raw[-1] ^= 1
    stream = Stream(bytes(raw) + tail)
    header, rest = read_frame_header(stream.readinto, len(raw))
    with pytest.raises(PayloadError, match="digest"):
        s.apply_stream(header, stream.readinto, rest)
    assert stream.read() == tail
    assert s.staged == {}
    # the round goes on: the same bucket sent again, intact, is taken
    good = _payload([("b", torch.ones(33))], index=1, last=True)
    stream = Stream(_frame_bytes(good))
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()))
    assert s.apply_stream(header, stream.readinto, rest) == good.digest


def test_streamed_round_semantics_are_the_buffered_ones(components: Any) -> None:
    live = _live()
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    p0 = _payload([("a", live["a"])], index=0, last=False)
    for _ in range(2):          # a retried bucket that was already staged: taken once
        stream = Stream(_frame_bytes(p0))
        header, rest = read_frame_header(stream.readinto, len(stream.getvalue()))
        assert s.apply_stream(header, stream.readinto, rest) == p0.digest
        assert stream.read() == b""
    again = _payload([("a", live["a"])], index=1)            # the same name in another bucket
    stream = Stream(_frame_bytes(again))
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()))
    with pytest.raises(PayloadError, match="already sent"):
        s.apply_stream(header, stream.readinto, rest)
    s.close()
    late = _payload([("b", live["b"])], index=2)
    stream = Stream(_frame_bytes(late))
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()))
    with pytest.raises(PayloadError, match="closed"):
        s.apply_stream(header, stream.readinto, rest)
    assert stream.read() == b""


def test_truncated_and_lying_bodies_are_refused(components: Any) -> None:
    live = _live()
    p = _payload(list(live.items()))
    body = p.body.numpy().tobytes()
    with pytest.raises(PayloadError, match="ended"):
        read_staged(p, BodyReader(io.BytesIO(body[:-10]).readinto, len(body)),
                    lambda n, d, s: torch.empty(s, dtype=d), lambda n, t: None)
    p2 = _payload([(n, t) for n, t in live.items() if n != "d"])
    with pytest.raises(PayloadError, match="carries tensors"):     # header and body disagree
        read_staged(p2, BodyReader(io.BytesIO(body).readinto, len(body)),
                    lambda n, d, s: torch.empty(s, dtype=d), lambda n, t: None)
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    header = {**p.header(), "nbytes": len(body) + 1}
    stream = Stream(body + b"x")
    with pytest.raises(PayloadError, match="truncated"):
        s.apply_stream(header, stream.readinto, len(body))
    with pytest.raises(PayloadError, match="ended after"):
        read_exact(io.BytesIO(b"abc").readinto, memoryview(bytearray(4)))


def test_non_streaming_encodings_fall_back_to_the_whole_body(components: Any) -> None:
    live = _live()
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    p = _payload(list(live.items()))
    mlh = {**p.header(), "digest": "mlh:" + p.digest}              # another digest algorithm
    assert not s.streams(mlh)
    stream = Stream(p.body.numpy().tobytes())
    with pytest.raises(PayloadError, match="digest"):               # read whole, then refused
        s.apply_stream(mlh, stream.readinto, p.body.numel())
    assert stream.read() == b""


# -- the body server ----------------------------------------------------------------------------
def test_a_body_is_fetched_once_in_binary_with_its_token() -> None:
    live = _live()
    p = _payload(list(live.items()))
    server = BodyServer()
    try:
        ref = server.publish(p.body)
        assert ref["url"].startswith("http://127.0.0.1:") and ref["nbytes"] == p.body.numel()
        wrong = requests.get(ref["url"], headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 404                          # and it is still there
        staged, digests = fetch(ref, lambda r, n: read_staged(
            p, BodyReader(r, n), lambda name, d, s: torch.empty(s, dtype=d), lambda n, t: None),
            max_bytes=1 << 30)
        assert dict(staged).keys() == live.keys()
        assert all(torch.equal(dict(staged)[n], t) for n, t in live.items())
        assert server.published() == 0                           # one fetch, then gone
        with pytest.raises(TransportError, match="404"):
            fetch(ref, lambda r, n: None, max_bytes=1 << 30)
        ref2 = server.publish(p.body, fetches=2)
        server.withdraw(ref2)
        with pytest.raises(TransportError, match="404"):
            fetch(ref2, lambda r, n: None, max_bytes=1 << 30)
        ref3 = server.publish(b"0123456789")
        with pytest.raises(PayloadError, match="limit"):
            fetch(ref3, lambda r, n: None, max_bytes=5)
        with pytest.raises(PayloadError, match="announced"):
            fetch({**ref3, "nbytes": 11}, lambda r, n: None, max_bytes=100)
        with pytest.raises(PayloadError, match="plain http"):
            fetch({**ref3, "url": "file:///etc/passwd"}, lambda r, n: None, max_bytes=100)
        whole = fetch(server.publish(b"0123456789"), lambda r, n: (lambda b: (read_exact(r, b), bytes(b))[1])(
            memoryview(bytearray(n))), max_bytes=100)
        assert whole == b"0123456789"
        assert requests.post(ref["url"], data=b"x", timeout=10).status_code in (404, 405, 501)
    finally:
        server.close()


@pytest.mark.parametrize("streamed", [True, False])
def test_a_bucket_that_names_a_tensor_twice_is_refused_on_either_path(components: Any,
                                                                      streamed: bool) -> None:
    live = _live()
    s = _session(components, DictStore({n: t.clone() for n, t in live.items()}))
    twice = _payload([("b", live["b"] + 1), ("b", live["b"] + 2)])
    tail = b"NEXT REQUEST"
    stream = Stream(_frame_bytes(twice) + tail)
    header, rest = read_frame_header(stream.readinto, len(stream.getvalue()) - len(tail))
    with pytest.raises(PayloadError, match="bucket 0 names tensor 'b' twice; a tensor is sent once"):
        if streamed:
            s.apply_stream(header, stream.readinto, rest)
        else:
            body = bytearray(rest)
            read_exact(stream.readinto, memoryview(body))
            s.apply(header, memoryview(body))
    assert stream.read() == tail                                  # the body, and only it, read
    assert s.staged == {} and torch.equal(s.store.get("b"), live["b"])     # nothing staged
