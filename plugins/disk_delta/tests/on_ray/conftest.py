"""One Ray cluster of three nodes on this machine for the disk_delta plugin's Ray tests, laid out
as core's on_ray suite lays out its own (a head node for the trainer's ranks and two engine
nodes, told apart by their resources), started once, in its own
temporary directory and ports, and shut down after the last Ray test; plus a per-test list of
actors to end, so a failing test leaves nothing running."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("ray")

NODES = [{"resources": {"trainer": 2}},                      # head: the trainer's two ranks
         {"resources": {"engine": 2, "node_a": 100}},        # two engine actors fit here
         {"resources": {"engine": 1, "node_b": 100}}]        # and one here


_OPEN: list[Any] = []          # the running cluster's context, closed after the last Ray test


def _close() -> None:
    while _OPEN:
        _OPEN.pop().__exit__(None, None, None)


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    """The cluster; yields the node id of each role: head, a, b."""
    import ray

    from weightsync.ray.cluster import local_cluster
    ctx = local_cluster(NODES, namespace="weightsync-tests")
    ctx.__enter__()
    _OPEN.append(ctx)
    try:
        ids = {}
        for n in ray.nodes():
            res = n["Resources"]
            role = "head" if "trainer" in res else "a" if "node_a" in res else "b"
            ids[role] = n["NodeID"]
        yield ids
    finally:
        _close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The cluster ends with the last Ray test, not with the session: its raylets and this
    process's Ray driver otherwise stay up through every later suite and have killed a vLLM
    server of the vLLM plugin's tests and skewed a peak-memory reading. The Ray tests run one
    after another (one directory), so a later test never needs the cluster again."""
    yield
    here = Path(__file__).parent
    if _OPEN and (nextitem is None or here not in Path(nextitem.path).parents):
        _close()


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
