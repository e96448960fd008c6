"""How the suite runs in parallel (`make test`: pytest-xdist on two workers). The controller
hands out units of work, and each unit runs whole, in order, on one worker:

- a group below is one unit: its tests run one after another, never two at once;
- every other test module is one unit, so its module-scoped fixtures (engine processes, live
  servers) start once, not once on each worker that happens to get one of its tests.

One group, `serial`: what must not overlap itself. The Ray clusters (three raylets each), the
live vLLM servers (the vllm plugin, the TRL integration, the elastic-fleet test, Megatron's
push into vLLM), the tests that build wheels and fresh virtual environments (several pips at
once), and the tests whose leases, deadlines and kills are timed against another process
(protocol, registry, catch-up, shm and disk_delta crash tests). It is the longest unit (about
half the suite's time), so it goes out first and the other worker takes every other module
meanwhile. (Split into three groups on three workers, the suite ran slower under load and a
3 s payload deadline failed.)

The units come from `pytest_xdist_make_scheduler` below, not from `xdist_group` marks: with
pytest 9.2 and pytest-xdist 3.8, `--dist loadgroup` ignores the marks (xdist tags a test's
node id with its group, which pytest 9.2 no longer lets it change), and the suite then ran
test by test on every worker with no group kept together. Without xdist this file does
nothing.

What a test module sets in os.environ (itself, or a library it imports) is undone when it ends.

Every pytest process (each worker, or the one process without xdist) also runs a fork server
(`weightsync_reference.forkserver`): a reference engine's start forks from a process that has
imported torch and weightsync already, instead of spending about 3 s of CPU on imports, and the
suite starts about 300 of them. Tests do not wait for it: starts before it listens go fresh."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent
GROUPS = {
    "serial": ["plugins/ray/tests/on_ray/", "plugins/disk_delta/tests/on_ray/", "tests/test_packaging.py",
               "tests/test_tutorial.py", "plugins/vllm/tests/", "integrations/trl/tests/",
               "tests/test_fleet.py", "tests/test_fleet_registry.py", "tests/test_protocol.py",
               "tests/test_catch_up.py", "core/tests/test_transport_shm.py",
               "plugins/disk_delta/tests/test_crash.py", "plugins/disk_delta/tests/test_agent_loop.py",
               "plugins/nixl/tests/test_vllm.py", "plugins/megatron/tests/test_push_vllm.py"],
}


def group_of(path: Path, root: Path = ROOT,
             groups: Mapping[str, Sequence[str]] = GROUPS) -> str | None:
    """The group of a test file, by its path under `root` (None: in no group)."""
    try:
        rel = path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    for group, prefixes in groups.items():
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes):
            return group
    return None


def unit_of(nodeid: str, root: Path = ROOT,
            groups: Mapping[str, Sequence[str]] = GROUPS) -> str:
    """The unit of work of a test: its group, else its module (node ids start with the path)."""
    path = nodeid.split("::", 1)[0]
    return group_of(root / path, root, groups) or path


def make_scheduler(config: pytest.Config, log: Any, root: Path = ROOT,
                   groups: Mapping[str, Sequence[str]] = GROUPS) -> Any:
    """xdist's scope scheduling with `unit_of` as the scope: each unit goes whole to one worker.
    The groups go out first (they are the longest units, and a long unit handed out last leaves
    the other worker idle at the end), then modules by their number of tests."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, root, groups)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:        # the queue is complete before the first unit goes out
                self.ordered = True
                units = sorted(self.workqueue.items(),
                               key=lambda kv: (kv[0] not in groups, -len(kv[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return Units(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return make_scheduler(config, log)


@pytest.fixture(scope="module", autouse=True)
def environment_kept() -> Iterator[None]:
    """os.environ as it was before each module, once the module is done: what its tests, or the
    libraries they import, set stays in the module. Importing vLLM (or TRL, which imports it)
    sets VLLM_*, TORCHINDUCTOR_* and LD_LIBRARY_PATH; the fork server forks only for an
    environment like its own, so every engine start after such a module went fresh (about 40
    starts of 3-10 CPU-s each on the serial worker)."""
    saved = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # pytest's own
    yield
    for key in set(os.environ) - set(saved):
        if not key.startswith("PYTEST_"):
            del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[str | None]:
    """A fork server for this pytest process and the processes it starts (None: not running, as
    in an environment without the reference engine; starts then take fresh processes)."""
    try:
        from weightsync_reference.forkserver import serving
    except ImportError:
        yield None
        return
    with serving(wait=False) as path:      # starts go fresh until it listens
        yield path
