"""The engine's registered staging buffers: reused by size, grown when too small, never handed to
two readers at once, and a buffer whose read failed is never handed out again."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

from weightsync_nixl.agent import agent  # noqa: E402
from weightsync_nixl.staging import MIN_BYTES, Staging  # noqa: E402


def test_buffers_of_different_sizes_are_reused_grown_and_never_shared() -> None:
    pool = Staging(agent("engine"))
    big, small = 3 * MIN_BYTES, MIN_BYTES // 2
    with pool.slot(big) as a, pool.slot(small) as b:        # two readers: two buffers
        assert a.numel() == big and b.numel() == small
        assert a.data_ptr() != b.data_ptr()
    assert len(pool.free) == 2
    with pool.slot(2 * MIN_BYTES) as c:                      # the smallest that fits: a's
        assert c.data_ptr() == a.data_ptr()
    with pool.slot(5 * MIN_BYTES) as d, pool.slot(5 * MIN_BYTES) as e:   # none fits: grown
        assert d.numel() == e.numel() == 5 * MIN_BYTES and d.data_ptr() != e.data_ptr()
    with pytest.raises(RuntimeError):
        with pool.slot(MIN_BYTES) as f:
            failed = f.data_ptr()
            raise RuntimeError("the READ into it failed")
    with pool.slot(MIN_BYTES) as g:
        assert g.data_ptr() != failed                        # a failed buffer is buried
