"""UCX over TCP on loopback for every process the tests start (they inherit this environment):
no RDMA device here. UCX_MODULES=^efa avoids the exit crash with Debian's ibverbs-providers."""

from __future__ import annotations

import os

from weightsync_nixl.testing import LOOPBACK_UCX

for _k, _v in {**LOOPBACK_UCX, "NIXL_LOG_LEVEL": "WARN"}.items():
    os.environ.setdefault(_k, _v)
