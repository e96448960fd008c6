"""The digest every receiver checks: per tensor, then combined; hashed on every core."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.wire.bucket import combine_digests, digest_algo, digest_tensors, tensor_digest
from weightsync.wire.pool import map_threads


def _named(n: int = 6) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(257 * (i + 1), generator=g).to(torch.bfloat16)) for i in range(n)]


def test_a_group_digest_is_its_tensor_digests_combined() -> None:
    named = _named()
    per = [tensor_digest(n, t) for n, t in named]
    assert digest_tensors(named) == combine_digests(per)
    assert digest_tensors(named[:1]) == per[0]                 # one tensor: its own digest
    assert len(set(per)) == len(per)


@pytest.mark.parametrize("change", ["bit", "name", "order", "dtype", "shape"])
def test_any_difference_changes_the_digest(change: str) -> None:
    named = _named()
    before = digest_tensors(named)
    if change == "bit":
        t = named[3][1].clone()
        t.view(torch.int16)[100] ^= 1
        named[3] = (named[3][0], t)
    elif change == "name":
        named[2] = ("other", named[2][1])
    elif change == "order":
        named[0], named[1] = named[1], named[0]
    elif change == "dtype":
        named[1] = (named[1][0], named[1][1].view(torch.float16))
    else:
        named[4] = (named[4][0], named[4][1].reshape(5, -1))
    assert digest_tensors(named) != before


def test_map_threads_keeps_order_raises_and_nests_without_deadlock() -> None:
    seen: set[str] = set()

    def inner(x: int) -> int:
        seen.add(threading.current_thread().name)
        return sum(map_threads(lambda y: y * x, range(4)))    # nested: runs inline, never waits

    assert map_threads(inner, range(20)) == [6 * x for x in range(20)]

    def boom(x: int) -> int:
        if x == 3:
            raise ValueError("item 3")
        return x

    with pytest.raises(ValueError, match="item 3"):
        map_threads(boom, range(8))


def test_a_forked_child_gets_a_working_pool() -> None:
    """A trainer that forks (DataLoader workers) after hashing: the child's pool has no threads,
    so it must start its own instead of waiting forever."""
    import multiprocessing as mp
    named = _named()
    want = digest_tensors(named)                     # the parent's pool now exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(digest_tensors(named)))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0, "the forked child hung or failed"
    assert q.get(timeout=5) == want


# -- mlh: the device-side digest, computed here with torch integer ops ---------------------------
def test_mlh_is_deterministic_and_differs_from_xxh3() -> None:
    named = _named()
    a = digest_tensors(named, "mlh")
    assert a.startswith("mlh:") and a == digest_tensors([(n, t.clone()) for n, t in named], "mlh")
    assert a != digest_tensors(named) and not digest_tensors(named).startswith("mlh:")
    assert digest_algo(a) == "mlh" and digest_algo(digest_tensors(named)) == "xxh3"


@pytest.mark.parametrize("seed", range(8))
def test_mlh_catches_a_flipped_bit_anywhere(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(3 * 2**20 + 11, generator=g).to(torch.bfloat16)   # 3 chunks and a tail
    want = tensor_digest("w", t, "mlh")
    pos = int(torch.randint(0, t.numel() * 2, (1,), generator=g))
    bit = int(torch.randint(0, 8, (1,), generator=g))
    u = t.clone().view(torch.uint8)
    u[pos] ^= 1 << bit
    assert tensor_digest("w", u.view(torch.bfloat16), "mlh") != want


def test_mlh_of_a_misaligned_view_equals_its_aligned_copy() -> None:
    buf = torch.arange(4099, dtype=torch.int16).view(torch.uint8)
    view = buf[2:2 + 2 * 4093].view(torch.int16)       # starts 2 bytes into a word
    assert view.data_ptr() % 4 == 2
    assert tensor_digest("x", view, "mlh") == tensor_digest("x", view.clone(), "mlh")
    assert tensor_digest("x", torch.empty(0), "mlh") != tensor_digest("y", torch.empty(0), "mlh")


def test_mlh_zero_padding_of_the_last_word_is_not_a_collision() -> None:
    a = torch.tensor([1, 2, 3], dtype=torch.uint8)
    b = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert tensor_digest("x", a, "mlh") != tensor_digest("x", b, "mlh")   # shape is hashed
    assert tensor_digest("x", a.view(1, 3), "mlh") != tensor_digest("x", a, "mlh")


def test_unknown_digest_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        tensor_digest("x", torch.zeros(1), "md5")
