"""One Ray cluster of three nodes on this machine for the Ray tests of this directory
(weightsync_ray.fixtures), shut down after its last test."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from weightsync_ray.fixtures import ray_cluster_fixtures  # noqa: E402 - after the skip

cluster, cleanup, pytest_runtest_teardown = ray_cluster_fixtures(Path(__file__).parent)
