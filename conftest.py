"""How the suite runs in parallel (`make test`: pytest-xdist, `--dist loadgroup`). Every test runs
on one of the workers; the tests of one group below run one after another on the same worker, so
they never overlap each other (and share their session fixtures). Without xdist the marks do
nothing.

- `serial`: what must not overlap each other: the live vLLM servers (one or two at a time, each
  several GiB), and the tests whose leases, deadlines and kills are timed against another process
  (fleet, protocol, shm and disk_delta crash tests);
- `ray`: the Ray clusters (three raylets each, one cluster at a time). They may run beside
  `serial`: every wait in either group is bounded on the state it waits for, not on a time, and
  the two were the suite's long pole when they shared one worker (the other worker idled);
- `fresh-env`: the tests that build wheels and fresh virtual environments once per session
  (packaging, tutorial), which would otherwise be built once per worker."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
GROUPS = {
    "serial": ["plugins/vllm/tests/", "tests/test_fleet.py", "tests/test_fleet_registry.py",
               "tests/test_protocol.py", "tests/test_catch_up.py", "core/tests/test_transport_shm.py",
               "plugins/disk_delta/tests/test_crash.py", "plugins/disk_delta/tests/test_agent_loop.py"],
    "ray": ["core/tests/on_ray/", "plugins/disk_delta/tests/on_ray/"],
    "fresh-env": ["tests/test_packaging.py", "tests/test_tutorial.py"],
}


def group_of(path: Path) -> str | None:
    """The xdist group of a test file, by its path in the repository (None: any worker)."""
    try:
        rel = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    for group, prefixes in GROUPS.items():
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes):
            return group
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = group_of(Path(item.path))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
