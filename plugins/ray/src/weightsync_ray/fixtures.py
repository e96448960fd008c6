"""One Ray cluster of three nodes on this machine for a directory of Ray tests (a head node for
the trainer's ranks and two engine nodes, told apart by their resources), started once, in its
own temporary directory and ports, and shut down after the directory's last test; plus a
per-test list of actors to end, so a failing test leaves nothing running. A conftest takes them:

    cluster, cleanup, pytest_runtest_teardown = ray_cluster_fixtures(Path(__file__).parent)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

NODES = [{"resources": {"trainer": 2}},                      # head: the trainer's two ranks
         {"resources": {"engine": 2, "node_a": 100}},        # two engine actors fit here
         {"resources": {"engine": 1, "node_b": 100}}]        # and one here


def ray_cluster_fixtures(here: Path) -> tuple[Any, Any, Any]:
    """The `cluster` and `cleanup` fixtures and the teardown hook for the tests under `here`."""
    opened: list[Any] = []          # the running cluster's context, closed after the last test

    def close() -> None:
        while opened:
            opened.pop().__exit__(None, None, None)

    @pytest.fixture(scope="session")
    def cluster() -> Iterator[dict[str, str]]:
        """The cluster; yields the node id of each role: head, a, b."""
        import ray

        from weightsync_ray.cluster import local_cluster
        ctx = local_cluster(NODES, namespace="weightsync-tests")
        ctx.__enter__()
        opened.append(ctx)
        try:
            ids = {}
            for n in ray.nodes():
                res = n["Resources"]
                role = "head" if "trainer" in res else "a" if "node_a" in res else "b"
                ids[role] = n["NodeID"]
            yield ids
        finally:
            close()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        """The cluster ends with the directory's last test, not with the session: its raylets
        and the test process's Ray driver otherwise stay up through every later suite (they
        once killed a vLLM test server and skewed a peak-memory reading)."""
        yield
        if opened and (nextitem is None or here not in Path(nextitem.path).parents):
            close()

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

    return cluster, cleanup, pytest_runtest_teardown
