"""The per-tensor codec: every kind round-trips bit for bit; corrupt input is refused."""

import pytest
import torch

from weightsync.errors import PayloadError
from weightsync_disk_delta.codec import apply_entry, encode_tensor


def _changed(base: torch.Tensor, density: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    n = int(density * base.numel())
    idx = torch.randperm(base.numel(), generator=g)[:n]
    new.view(-1)[idx] = (torch.randn(n, generator=g) * 3).to(base.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("density,kind", [(0.0, "sparse"), (0.001, "sparse"), (0.05, None), (0.6, "full")])
def test_round_trip_is_bit_exact(dtype: torch.dtype, density: float, kind: str | None) -> None:
    base = (torch.randn(64, 200) * 3).to(dtype)
    if dtype.is_floating_point:
        base.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    new = _changed(base, density)
    enc = encode_tensor("w", new, base, density_threshold=0.25, zstd_level=1,
                        xor_min_density=0.01)
    if kind is not None:
        assert enc.entry["kind"] == kind
    if density == 0.05:
        assert enc.entry["kind"] in ("sparse", "xor")
    assert enc.changed == int((new.view(-1) != base.view(-1)).sum()) or dtype.is_floating_point
    out, _, _ = apply_entry("w", enc.entry, dict(enc.arrays), base, str(dtype).removeprefix("torch."),
                            list(base.shape))
    assert torch.equal(out.contiguous().view(torch.uint8), new.view(torch.uint8))


@pytest.mark.parametrize("form", ["sparse", "xor"])
def test_both_forms_round_trip_and_cheaper_is_chosen(form: str) -> None:
    base = torch.randn(100_000).to(torch.bfloat16)
    new = base.clone()                                 # 2 % of elements move by one ulp (xor wins)
    new.view(torch.int16)[torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:2000]] += 1
    sizes = {}
    for f, xor_min in (("sparse", 1.0), ("xor", 0.0)):
        enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=xor_min,
                            xor_max_ratio=1.0)
        sizes[enc.entry["kind"]] = sum(a.numel() * a.element_size() for _, a in enc.arrays)
        out, _, _ = apply_entry("w", enc.entry, dict(enc.arrays), base, "bfloat16", [100_000])
        assert torch.equal(out.view(torch.int16), new.view(torch.int16))
    assert set(sizes) == {"sparse", "xor"}
    both = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=0.0,
                         xor_max_ratio=1.0)
    assert both.entry["kind"] == min(sizes, key=sizes.get)
    # by default xor must be at most 0.7 of the sparse bytes: it costs several times the CPU
    default = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=0.0)
    assert default.entry["kind"] == ("xor" if sizes["xor"] < 0.7 * sizes["sparse"] else "sparse")


@pytest.mark.parametrize("density,form", [(0.0005, "gap16"), (0.01, "gap8"), (0.2, "gap8")])
def test_positions_are_stored_as_gaps_in_the_fewest_bytes(density: float, form: str) -> None:
    base = torch.randn(1 << 18).to(torch.bfloat16)
    new = _changed(base, density)
    enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=1.0)
    assert enc.entry == {"kind": "sparse", "changed": enc.changed, "pos": form}
    pos_bytes = sum(a.numel() * a.element_size() for k, a in enc.arrays if not k.endswith("::val"))
    assert pos_bytes < 4 * enc.changed * (0.6 if form == "gap8" else 0.55)
    out, _, _ = apply_entry("w", enc.entry, dict(enc.arrays), base, "bfloat16", [1 << 18])
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("pos,arrays,match", [
    ("idx", {"w::idx": torch.tensor([500], dtype=torch.int32)}, "out of range"),
    ("idx", {"w::idx": torch.tensor([7, 7], dtype=torch.int32)}, "not ascending"),
    ("gap8", {"w::gap8": torch.tensor([200], dtype=torch.uint8),
              "w::far": torch.zeros(0, dtype=torch.int32)}, "run past"),
    ("gap8", {"w::gap8": torch.tensor([0], dtype=torch.uint8),
              "w::far": torch.zeros(0, dtype=torch.int32)}, "do not match their escapes"),
    ("gap8", {"w::gap8": torch.tensor([0], dtype=torch.uint8),
              "w::far": torch.tensor([0], dtype=torch.int32)}, "do not match their escapes"),
    ("gap16", {"w::gap16": torch.tensor([3], dtype=torch.int32),
               "w::far": torch.zeros(0, dtype=torch.int32)}, "malformed"),
])
def test_corrupt_positions_are_refused(pos: str, arrays: dict, match: str) -> None:
    base = torch.zeros(100, dtype=torch.bfloat16)
    n = next(iter(arrays.values())).numel()
    entry = {"kind": "sparse", "changed": n, "pos": pos}
    arrays = {**arrays, "w::val": torch.ones(n, dtype=torch.bfloat16)}
    with pytest.raises(PayloadError, match=match):
        apply_entry("w", entry, arrays, base, "bfloat16", [100])


def test_corrupt_xor_is_refused_and_base_untouched() -> None:
    base = torch.randn(10_000).to(torch.bfloat16)
    new = base.clone()                                 # 10 % of elements move by one ulp
    new.view(torch.int16)[torch.randperm(10_000, generator=torch.Generator().manual_seed(0))[:1000]] += 1
    enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=0.0,
                        xor_max_ratio=1.0)
    assert enc.entry["kind"] == "xor"
    z = dict(enc.arrays)["w::xor"].clone()
    z[len(z) // 2] ^= 0xFF
    before = base.clone()
    with pytest.raises(PayloadError):
        out, _, _ = apply_entry("w", enc.entry, {"w::xor": z}, base, "bfloat16", [10_000])
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [1, 7, 4096, 3 * (1 << 16) * 8 + 5, 3 * (1 << 16) * 8])
def test_changed_positions_match_a_plain_compare(dtype: torch.dtype, numel: int) -> None:
    """The word-at-a-time search equals an element-by-element compare for every element size,
    for lengths that do and do not fill whole words, across chunk boundaries, and for the
    nonzero search the xor form uses; past the limit it only counts."""
    from weightsync_disk_delta.codec import bits, changed_positions
    g = torch.Generator().manual_seed(numel)
    base = torch.randint(0, 100, (numel,), generator=g).to(dtype)
    new = _changed(base, 0.03, seed=numel)
    new.view(-1)[-1] = new.view(-1)[-1] + 1                  # the very last element changes too
    want = torch.nonzero(bits(new) != bits(base)).view(-1)
    idx, count = changed_positions(bits(new), bits(base), numel)
    assert count == want.numel() and torch.equal(idx, want)
    nz = torch.nonzero(bits(new)).view(-1)
    idx, count = changed_positions(bits(new), None, numel)
    assert count == nz.numel() and torch.equal(idx, nz)
    idx, count = changed_positions(bits(new), bits(base), want.numel() - 1)
    assert idx is None and count == want.numel()
    idx, count = changed_positions(bits(new), bits(base), -1)
    assert idx is None and count == want.numel()


def test_a_delta_without_the_current_tensor_is_refused_by_name() -> None:
    base = torch.randn(1000).to(torch.bfloat16)
    enc = encode_tensor("w", _changed(base, 0.01), base, density_threshold=0.5, zstd_level=1,
                        xor_min_density=1.0)
    with pytest.raises(PayloadError, match="'w': a sparse delta needs the current tensor"):
        apply_entry("w", enc.entry, dict(enc.arrays), None, "bfloat16", [1000])
