"""The one-pass copy + digest (`weightsync.wire.digests`): on every path (numba's compiled loop, the
Python loop over the C functions, torch's copy then the xxhash package) the digest is xxh3-128
of the header and the bytes written, bit for bit, and the copy is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from weightsync.wire import digests as hashing
from weightsync.wire.bucket import Bucket, digest_tensors, tensor_digest, tensor_header
from weightsync.encodings.raw import RawEncoding
from weightsync.receive import stage_digest
from weightsync.wire.frame import pack, pack_digest, unpack

PATHS = ["numba", "ctypes", "two-pass"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    p = request.param
    if p == "numba":
        pytest.importorskip("numba")
        monkeypatch.setattr(hashing, "JIT", True)
        assert hashing.jit() is not None
    else:
        monkeypatch.setattr(hashing, "JIT", False)
        assert hashing.jit() is None
    if p == "two-pass":
        monkeypatch.setattr(hashing, "_loaded", True)
        monkeypatch.setattr(hashing, "_lib", None)
        assert hashing.Digest(b"").address is None
    assert hashing.path() == p
    return p


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("source", [False, True], ids=["hash-copy", "hash-source-stream"])
@pytest.mark.parametrize("nbytes", [0, 1, 7, 31, 33, 4096, 16 << 10, (16 << 10) + 3, (128 << 10) + 1,
                                    (1 << 20) + 4097, 3 << 20])
def test_copy_digest_is_xxh3_of_header_and_bytes(path: str, nbytes: int, source: bool) -> None:
    rng = np.random.default_rng(nbytes)
    src = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    header = b"model.layers.0.weight|uint8|[%d]\n" % nbytes
    for shift in (0, 1, 13):             # destinations at every alignment (streamed stores need 32)
        room = torch.full((nbytes + 64,), 7, dtype=torch.uint8)
        dst = room[shift: shift + nbytes]
        got = hashing.copy_digest(dst, src, header, source=source)
        assert got == xxhash.xxh3_128(header + _bytes(src)).hexdigest()
        assert torch.equal(dst, src)
        assert bool((room[:shift] == 7).all()) and bool((room[shift + nbytes:] == 7).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64])
def test_copy_digest_of_a_tensor_is_its_tensor_digest(path: str, dtype: torch.dtype) -> None:
    src = (torch.randn(301, 517) * 50).to(dtype)
    dst = torch.empty_like(src)
    assert hashing.copy_digest(dst, src, tensor_header("w", src)) == tensor_digest("w", src)
    assert torch.equal(dst, src)


def test_copy_digest_of_other_layouts_copies_then_hashes(path: str) -> None:
    src = torch.randn(64, 96).to(torch.bfloat16)
    strided = src.t()                           # not contiguous: torch copies, then hashes
    dst = torch.empty(96, 64, dtype=torch.bfloat16)
    assert hashing.copy_digest(dst, strided, tensor_header("w", dst)) == tensor_digest("w", strided.contiguous())
    assert torch.equal(dst, strided)
    cast = torch.empty(64, 96, dtype=torch.float32)   # another dtype: converted, digest of the result
    assert hashing.copy_digest(cast, src, tensor_header("w", cast)) == tensor_digest("w", src.float())
    with pytest.raises(ValueError, match="elements"):
        hashing.copy_digest(torch.empty(3), torch.empty(4), b"")


@pytest.mark.parametrize("source", [False, True])
def test_copy_digest_many_is_each_copy_digest_in_order(path: str, source: bool) -> None:
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(k, generator=g).to(torch.bfloat16) for k in (5, 70_000, 1, 0, 300_001, 64)]
    jobs = [(torch.empty_like(s), s, tensor_header(f"t{i}", s)) for i, s in enumerate(srcs)]
    got = hashing.copy_digest_many(jobs, source=source)
    assert got == [tensor_digest(f"t{i}", s) for i, s in enumerate(srcs)]
    assert all(torch.equal(d, s) for d, s, _ in jobs)


def test_digest_fed_by_address_is_the_same(path: str) -> None:
    data = torch.arange(100_000, dtype=torch.int32)
    d = hashing.Digest(b"h")
    d.update_at(data.data_ptr(), 1000)
    d.update_at(data.data_ptr() + 1000, data.numel() * 4 - 1000)
    assert d.hexdigest() == xxhash.xxh3_128(b"h" + _bytes(data)).hexdigest()
    assert hashing.digest_at(b"h", data.data_ptr(), 0) == xxhash.xxh3_128(b"h").hexdigest()


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [("a", torch.randn(1000, 37, generator=g).to(torch.bfloat16)),
            ("b", torch.randn(5, generator=g)),                       # fp32 goes first in the layout
            ("c", torch.randint(0, 9, (77,), generator=g, dtype=torch.int64)),
            ("d", torch.empty(0, 4, dtype=torch.bfloat16))]


def test_pack_digest_equals_pack_then_digest(path: str) -> None:
    named = _named()
    body, digests = pack_digest(named)
    assert torch.equal(body, pack(named))
    views = dict(unpack(body)[0])
    assert digests == {n: tensor_digest(n, views[n]) for n, _ in named}


def test_raw_encoding_digest_is_the_digest_of_the_packed_tensors(path: str) -> None:
    named = _named()
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    payload = RawEncoding().encode(Bucket(0, named, last=True), alloc=lambda n: buf[:n])
    assert payload.body.data_ptr() == buf.data_ptr()
    views = dict(unpack(payload.body)[0])
    assert payload.digest == digest_tensors([(n, views[n]) for n, _ in named]) == digest_tensors(named)


@pytest.mark.parametrize("private", [False, True])
def test_stage_digest_copies_into_the_buffers_and_digests_the_copies(path: str, private: bool) -> None:
    named = [(n, t) for n, t in _named() if t.numel()]
    into = {n: torch.full_like(t, 0) for n, t in named}
    staged, got = stage_digest(named, lambda n, t: into[n], "xxh3", private)
    assert [n for n, _ in staged] == [n for n, _ in named]
    assert all(s is into[n] and torch.equal(s, t) for (n, s), (_, t) in zip(staged, named))
    assert got == digest_tensors(named, "xxh3")


def test_the_fast_paths_are_there() -> None:
    """The xxhash package exports its C streaming functions (else every copy hashes in a second
    pass); numba is optional (`weightsync-core[fast]`), the Python loop is the fallback."""
    assert hashing.library() is not None
