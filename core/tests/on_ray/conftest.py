"""One Ray cluster of three nodes on this machine for every Ray test (a head node for the
trainer's ranks and two engine nodes, told apart by their resources), started once, in its own
temporary directory and ports, and shut down at the end; plus a per-test list of actors to end,
so a failing test leaves nothing running."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("ray")

NODES = [{"resources": {"trainer": 2}},                      # head: the trainer's two ranks
         {"resources": {"engine": 2, "node_a": 100}},        # two engine actors fit here
         {"resources": {"engine": 1, "node_b": 100}}]        # and one here


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    """The cluster; yields the node id of each role: head, a, b."""
    import ray

    from weightsync.ray.cluster import local_cluster
    with local_cluster(NODES, namespace="weightsync-tests"):
        ids = {}
        for n in ray.nodes():
            res = n["Resources"]
            role = "head" if "trainer" in res else "a" if "node_a" in res else "b"
            ids[role] = n["NodeID"]
        yield ids


@pytest.fixture
def cleanup(cluster: dict[str, str]) -> Iterator[list[Callable[[], Any]]]:
    """Append what ends a test's actors; run in reverse order after the test, pass or fail."""
    todo: list[Callable[[], Any]] = []
    yield todo
    for fn in reversed(todo):
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort: the next one must still run
            pass
