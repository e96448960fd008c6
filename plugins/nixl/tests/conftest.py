"""UCX over TCP on loopback for every process the tests start (they inherit this environment):
no RDMA device here. UCX_MODULES=^efa avoids the exit crash with Debian's ibverbs-providers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from weightsync_nixl.testing import LOOPBACK_UCX

for _k, _v in {**LOOPBACK_UCX, "NIXL_LOG_LEVEL": "WARN"}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="module", autouse=True)
def _fresh_agents() -> Iterator[None]:
    """Each module's NIXL agents in this process are its own (a trainer or engine process has
    its own): one process that ran the fault, peer-join and transport modules in turn with the
    same agents aborted inside NIXL's progress (get_new_notifs) in the third, not reproduced
    with the modules apart."""
    yield
    try:
        from weightsync_nixl.agent import fresh_agents
    except ImportError:          # NIXL not installed: the modules skipped
        return
    fresh_agents()
