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
    new = _changed(base, 0.02)
    sizes = {}
    for f, xor_min in (("sparse", 1.0), ("xor", 0.0)):
        enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=xor_min)
        sizes[enc.entry["kind"]] = sum(a.numel() * a.element_size() for _, a in enc.arrays)
        out, _, _ = apply_entry("w", enc.entry, dict(enc.arrays), base, "bfloat16", [100_000])
        assert torch.equal(out.view(torch.int16), new.view(torch.int16))
    both = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=0.0)
    assert both.entry["kind"] == min(sizes, key=sizes.get)


def test_out_of_range_position_is_refused() -> None:
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = base.clone()
    new[5] = 1
    enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=1.0)
    arrays = dict(enc.arrays)
    arrays["w::idx"] = torch.tensor([500], dtype=torch.int32)
    with pytest.raises(PayloadError, match="out of range"):
        apply_entry("w", enc.entry, arrays, base, "bfloat16", [100])


def test_corrupt_xor_is_refused_and_base_untouched() -> None:
    base = torch.randn(10_000).to(torch.bfloat16)
    new = _changed(base, 0.1)
    enc = encode_tensor("w", new, base, density_threshold=0.5, zstd_level=1, xor_min_density=0.0)
    assert enc.entry["kind"] == "xor"
    z = dict(enc.arrays)["w::xor"].clone()
    z[len(z) // 2] ^= 0xFF
    before = base.clone()
    with pytest.raises(PayloadError):
        out, _, _ = apply_entry("w", enc.entry, {"w::xor": z}, base, "bfloat16", [10_000])
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))
