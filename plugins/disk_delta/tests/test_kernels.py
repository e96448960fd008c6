"""The hot loops, compiled (numba) and plain (numpy/torch): both give exactly what a plain
element-by-element comparison gives, on every element width and on sizes that do not fill a word."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xxhash

from weightsync.wire.bucket import tensor_digest, tensor_hasher, tensor_header
from weightsync.errors import PayloadError
from weightsync.wire import digests as hashing
from weightsync_disk_delta import kernels, positions
from weightsync_disk_delta.codec import bits, encode_tensor


@pytest.fixture(params=["numba", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numba":
        monkeypatch.setattr(kernels, "JIT", True)
        assert kernels.jit() is not None, "numba comes with weightsync-disk-delta[fast]"
    else:
        monkeypatch.setattr(kernels, "JIT", False)
        assert kernels.jit() is None
    return request.param


def _pair(dtype: torch.dtype, numel: int, density: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-100, 100, (numel,), generator=g).to(torch.float32)
    if dtype == torch.uint8:
        base = torch.randint(0, 255, (numel,), generator=g, dtype=torch.uint8)
    else:
        base = (base * 0.37).to(dtype)
    new = base.clone()
    k = round(density * numel)
    idx = torch.randperm(numel, generator=g)[:k]
    b = bits(new)
    b[idx] = b[idx] ^ torch.randint(1, 7, (k,), generator=g).to(b.dtype)   # never 0: a change
    return new, base


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 7, 4099, 300_001])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.01, 0.3, 1.0])
def test_scan_finds_exactly_the_changed_elements(backend: str, dtype: torch.dtype, numel: int,
                                                 density: float) -> None:
    new, base = _pair(dtype, numel, density)
    nb, bb = bits(new), bits(base)
    want = torch.nonzero(nb != bb).reshape(-1)
    h = tensor_hasher("w", new)
    found = kernels.scan(nb, bb, numel, h)
    assert h.hexdigest() == tensor_digest("w", new)
    d = hashing.Digest(tensor_header("w", new))             # fed by the compiled loop itself
    again = kernels.scan(nb, bb, numel, d)
    assert d.hexdigest() == tensor_digest("w", new) and again.count == found.count
    assert found.count == want.numel()
    assert found.idx is not None and found.vals is not None
    assert torch.equal(found.idx, want)
    assert torch.equal(found.vals, nb[want])
    g = np.diff(want.numpy(), prepend=-1)
    assert (found.over8, found.over16) == (int((g > 255).sum()), int((g > 65535).sum()))
    if want.numel():                        # over the limit: counted exactly, no positions
        over = kernels.scan(nb, bb, want.numel() - 1)
        assert over.count == want.numel() and over.idx is None
    assert kernels.scan(nb, bb, -1).count == want.numel()


@pytest.mark.parametrize("density", [0.0005, 0.01, 0.2])
def test_gaps_round_trip_and_bad_escapes_are_refused(backend: str, density: float) -> None:
    numel = 1 << 20
    idx = torch.from_numpy(np.sort(np.random.default_rng(1).choice(numel, int(density * numel),
                                                                    replace=False)))
    form, arrays = positions.encode(idx, numel)
    again = positions.encode(idx, numel, None)
    assert form == again[0] and all(torch.equal(arrays[k], again[1][k]) for k in arrays)
    out = positions.decode("w", form, arrays, idx.numel(), numel)
    assert torch.equal(out, idx)
    for top, t in ((255, np.uint8), (65535, np.uint16)):
        small, far = kernels.gaps(idx.numpy(), top, t, np.int32, int((np.diff(idx.numpy(), prepend=-1) > top).sum()))
        assert np.array_equal(kernels.ungap(small, far, numel), idx.numpy())
        if far.size:
            assert kernels.ungap(small, far[:-1], numel) is None        # an escape without its gap
            bad = far.copy()
            bad[0] = 0
            assert kernels.ungap(small, bad, numel) is None             # a far gap below 1
        assert kernels.ungap(small, np.append(far, 300).astype(np.int32), numel) is None   # one too many
        assert kernels.ungap(small, far, int(idx[-1])) is None          # the last one past the end


def test_positions_past_the_end_are_refused_without_overflow(backend: str) -> None:
    """Escapes that would carry the running position past 2**63 (and wrap it back into range)
    are refused: every escape must be at most the tensor's size, every position inside it."""
    huge = np.array([2**62, 2**62, 2**62, 2**62], np.int64)       # sums to 2**64: wraps to -1 + 0
    small = np.zeros(4, np.uint8)
    assert kernels.ungap(small, huge, 32) is None
    assert kernels.ungap(np.array([1, 1, 40], np.uint8), np.zeros(0, np.int64), 32) is None
    parts = {"gap8": torch.from_numpy(small), "far": torch.from_numpy(huge)}
    with pytest.raises(PayloadError, match="run past|escapes"):
        positions.decode("w", "gap8", parts, 4, 32)
    with pytest.raises(PayloadError, match="malformed gap8"):         # not uint8: no numpy crash
        positions.decode("w", "gap8", {"gap8": torch.zeros(4, dtype=torch.bfloat16),
                                       "far": torch.zeros(0, dtype=torch.int32)}, 4, 32)
    with pytest.raises(PayloadError, match="changed positions in a tensor of 32"):
        positions.decode("w", "idx", {"idx": torch.arange(33)}, 33, 32)


@pytest.mark.parametrize("hashed", ["native", "python", "none"])
def test_kernels_refuse_positions_outside_the_tensor_before_writing(backend: str, hashed: str) -> None:
    """The issue's neighbour write (Python hash path) and silent drop (native path): positions
    past a tensor's end are an error, and nothing of the region was written."""
    region = torch.zeros(32, dtype=torch.int16)
    idx = torch.tensor([3, 31, 40], dtype=torch.int64)
    vals = torch.tensor([7, 8, 9], dtype=torch.int16)
    h = {"native": hashing.Digest(b"w"), "python": hashing.Digest(b"w", native=False),
         "none": None}[hashed]
    with pytest.raises(ValueError, match="run outside a tensor of 32"):
        kernels.swap(region, idx, vals, h)
    with pytest.raises(ValueError, match="run outside"):
        kernels.put(region, torch.tensor([-1, 3]), vals[:2])
    assert not region.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swap_writes_new_values_returns_old_ones_and_hashes_the_result(backend: str, dtype: torch.dtype) -> None:
    new, base = _pair(dtype, (3 << 20) + 5, 0.01, seed=2)     # several hash chunks and a tail
    nb, bb = bits(new), bits(base)
    idx = torch.nonzero(nb != bb).reshape(-1)
    for h in (tensor_hasher("w", new), hashing.Digest(tensor_header("w", new))):
        region = bb.clone()
        old = kernels.swap(region, idx, nb[idx], h)
        assert torch.equal(region, nb) and torch.equal(old, bb[idx])
        assert h.hexdigest() == tensor_digest("w", new)
        kernels.put(region, idx, old)
        assert torch.equal(region, bb)


def test_encode_is_the_same_with_and_without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    new, base = _pair(torch.bfloat16, 1 << 20, 0.01, seed=3)
    out = {}
    for jit in (True, False):
        monkeypatch.setattr(kernels, "JIT", jit)
        enc = encode_tensor("w", new, base, density_threshold=0.25, zstd_level=1, xor_min_density=0.02)
        out[jit] = (enc.entry, [(k, a.clone()) for k, a in enc.arrays], enc.digest)
    assert out[True][0] == out[False][0] and out[True][2] == out[False][2] == tensor_digest("w", new)
    assert all(k1 == k2 and torch.equal(a1, a2) for (k1, a1), (k2, a2) in zip(out[True][1], out[False][1]))


def test_the_compiled_loops_can_feed_xxhash_directly() -> None:
    """The xxhash package exports its C streaming functions and they agree with it; without
    them the loops still give the same digests, only through Python in large chunks."""
    assert hashing.library() is not None, (
        "the installed xxhash package no longer exports XXH3_128bits_*: digests stay right, but "
        "the compare and the host's write hash in a second pass (slower)")


@pytest.mark.parametrize("native", [True, False])
def test_digest_in_any_chunks_is_xxh3_128_of_header_and_bytes(native: bool) -> None:
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 70_001, dtype=np.uint8)
    header = b"model.layers.0.weight|bfloat16|[7, 10000]\n"
    want = xxhash.xxh3_128(header + data.tobytes()).hexdigest()
    for cuts in ([], [1], [63, 64, 65], [240, 241, 1000, 69_999], list(range(0, 70_001, 4096))):
        d = hashing.Digest(header, native=native)
        assert (d.address is not None) == native
        last = 0
        for c in cuts + [data.size]:
            d.update(data[last:c])
            last = c
        assert d.hexdigest() == want
