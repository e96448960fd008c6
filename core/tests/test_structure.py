"""The shape of the house (meta-tests, read statically from the sources): imports go one way, so
no import circle in core or any plugin package, and no source module is over 400 lines.

The import graph counts every import a module makes, at module level or inside a function (a
lazy import is still a dependency), except those under `if TYPE_CHECKING:` (never run). Relative
imports are resolved; `from pkg import name` is an edge to `pkg.name` when that is a module, else
to `pkg`. Importing a submodule is also an edge to each package above it (Python runs their
`__init__` first), except the packages the importing module itself lives in (they run before it
does). Core's root holds at most 8 modules (package files, CLI, errors, config, hookspecs, the
plugin system); everything else lives in a folder that is one layer or one component kind, and a
module that is split becomes a folder, never siblings beside it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# Modules still over MAX_LINES while others split them (each owned by a change in progress);
# remove an entry when its module is split, and the set is meant to end empty.
OVER_LIMIT_FOR_NOW: set[str] = set()


def package_roots() -> list[Path]:
    """core's package and every plugin's package directory."""
    return [ROOT / "core/src/weightsync"] + sorted(p for p in ROOT.glob("plugins/*/src/*")
                                                  if (p / "__init__.py").exists())


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every source module of every package."""
    out: dict[str, Path] = {}
    for root in package_roots():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:` (not their else)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            return
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return found


def _known(name: str, known: dict[str, Path]) -> str | None:
    """`name`, or its longest prefix that is a module of the graph."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the graph it imports."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                for alias in node.names:
                    sub = f"{full}.{alias.name}"
                    targets.append(sub if sub in known else full)
            own = _parents(mod) | ({mod} if path.name == "__init__.py" else set())
            for t in targets:
                hit = _known(t, known)
                if hit is None:
                    continue
                for target in {hit} | (_parents(hit) & set(known)) - own:
                    if target != mod:
                        graph[mod].add(target)
    return graph


def _parents(mod: str) -> set[str]:
    """The packages above a dotted module: `a.b.c` -> {`a`, `a.b`}."""
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), each as
    a path that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_circle(graph, comp) for comp in comps]


def _circle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside it."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(comp)


def test_the_graph_is_read() -> None:
    """The graph sees relative, absolute and lazy imports (else the next test proves nothing)."""
    graph = import_graph()
    assert "weightsync.sync.assembly" in graph["weightsync.sync.pipeline"]        # from .assembly import ...
    assert "weightsync.receive.staging" in graph["weightsync.receive.session"]   # a package's
    assert "weightsync_bench.gpu" in graph["weightsync_bench.harness"]  # lazy, in a method
    assert "weightsync.interfaces" not in graph["weightsync.hookspecs"]  # under TYPE_CHECKING
    assert any(t.startswith("weightsync") for t in graph["weightsync_disk_delta.plugin"])
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_cores_root_holds_at_most_8_modules() -> None:
    root = sorted(p.stem for p in (ROOT / "core/src/weightsync").glob("*.py"))
    assert len(root) <= 8, f"core's root has {len(root)} modules (at most 8): {root}; move the " \
        "others into the folder of their layer or component kind"


def test_a_split_lands_in_a_folder() -> None:
    """`x.py` beside `x_part.py`, or beside a folder `x/`, is a module split into siblings."""
    found = []
    for root in package_roots():
        for folder in [root, *(d for d in root.rglob("*") if d.is_dir())]:
            stems = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
            dirs = {d.name for d in folder.iterdir() if (d / "__init__.py").exists()}
            for stem in stems:
                found += [f"{folder.relative_to(ROOT)}: {stem}.py beside {s}.py" for s in stems
                          if s.startswith(stem + "_")]
                if stem in dirs:
                    found.append(f"{folder.relative_to(ROOT)}: {stem}.py beside {stem}/")
    assert not found, "split modules beside their parent (make a folder):\n" + "\n".join(found)


def test_no_source_module_over_400_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES and p not in OVER_LIMIT_FOR_NOW}
    assert not over, f"modules over {MAX_LINES} lines (split them by job): {over}"
    done = {p for p in OVER_LIMIT_FOR_NOW if sizes.get(p, 0) <= MAX_LINES}
    assert not done, f"these are {MAX_LINES} lines or fewer now: remove them from OVER_LIMIT_FOR_NOW: {done}"


def test_parallel_groups_name_real_test_files() -> None:
    """conftest.py's groups (what must not overlap under `make test`) name paths that exist, so
    a renamed test module cannot silently leave its group."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    missing = [p for paths in conf.GROUPS.values() for p in paths if not (ROOT / p).exists()]
    assert not missing, f"conftest.py GROUPS names paths that do not exist: {missing}"
    assert conf.group_of(ROOT / "plugins/ray/tests/on_ray/test_ray_cluster.py") == "serial"
    assert conf.group_of(ROOT / "core/tests/test_wire.py") is None
    assert conf.unit_of("plugins/vllm/tests/test_live_moe.py::test_x[a::b]") == "serial"
    assert conf.unit_of("core/tests/test_wire.py::TestA::test_b[1]") == "core/tests/test_wire.py"


_UNIT_MODULE = """
import os, time
import pytest

@pytest.fixture(scope="module")
def server():
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(f"setup {__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    yield

@pytest.mark.parametrize("i", range(N))
def test_one(server, i):
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(f"run {__name__} {os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}\\n")
    time.sleep(0.05)
"""


def _run_units(tmp_path: Path, workers: int) -> list[list[str]]:
    """A pytest session of four modules on `workers` xdist workers with conftest.py's scheduler:
    test_grp_a and test_grp_b (2 tests each) form a group, test_a_solo and test_b_solo (6 tests
    each) do not. Returns the modules' log lines: setup MODULE WORKER, run MODULE WORKER TIME."""
    import os
    import subprocess
    import sys
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\nfrom pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('root_conftest', {str(ROOT / 'conftest.py')!r})\n"
        "conf = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(conf)\n"
        "def pytest_xdist_make_scheduler(config, log):\n"
        "    return conf.make_scheduler(config, log, Path(__file__).parent,\n"
        "                               {'serial': ['test_grp_a.py', 'test_grp_b.py']})\n")
    for name, n in (("test_grp_a", 2), ("test_grp_b", 2), ("test_a_solo", 6), ("test_b_solo", 6)):
        (tmp_path / f"{name}.py").write_text(_UNIT_MODULE.replace("range(N)", f"range({n})"))
    log = tmp_path / "units.log"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadscope",
                        "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "UNITS_LOG": str(log)})
    assert r.returncode == 0, r.stdout + r.stderr
    return [ln.split() for ln in log.read_text().splitlines()]


def test_xdist_runs_each_group_and_each_module_whole_on_one_worker(tmp_path: Path) -> None:
    """The scheduler in conftest.py, under a real two-worker xdist run: a module's fixture starts
    once, and a group's modules run on one worker one after another. (`--dist loadgroup` with
    `xdist_group` marks split every module across both workers under pytest 9.2.)"""
    lines = _run_units(tmp_path, 2)
    setups = sorted((m, w) for kind, m, w, *_ in lines if kind == "setup")
    assert [m for m, _ in setups] == ["test_a_solo", "test_b_solo", "test_grp_a", "test_grp_b"], setups
    workers = {m: {w for kind, mm, w, *_ in lines if mm == m} for m, _ in setups}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["test_grp_a"] == workers["test_grp_b"], workers
    runs = [(m, float(t)) for kind, m, _, t in (ln for ln in lines if ln[0] == "run")]
    group = [m for m, _ in sorted((x for x in runs if x[0].startswith("test_grp")), key=lambda x: x[1])]
    assert group in (["test_grp_a"] * 2 + ["test_grp_b"] * 2, ["test_grp_b"] * 2 + ["test_grp_a"] * 2), group


def test_xdist_hands_out_the_groups_first(tmp_path: Path) -> None:
    """On one worker the units run in the order they are handed out: the group (4 tests),
    although the two other modules have more tests and come first in collection."""
    order = [m for kind, m, *_ in _run_units(tmp_path, 1) if kind == "run"]
    assert order[:4] in (["test_grp_a"] * 2 + ["test_grp_b"] * 2, ["test_grp_b"] * 2 + ["test_grp_a"] * 2), order


def test_what_a_module_sets_in_the_environment_stays_in_the_module(tmp_path: Path) -> None:
    """conftest.py's `environment_kept`: a module that sets variables (as importing vLLM does:
    VLLM_*, TORCHINDUCTOR_*, LD_LIBRARY_PATH) or removes one keeps that for its own tests; the
    next module sees the environment as it was, so the fork server still forks its engines."""
    import os
    import subprocess
    import sys
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('root_conftest', {str(ROOT / 'conftest.py')!r})\n"
        "conf = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(conf)\n"
        "environment_kept = conf.environment_kept\n")
    (tmp_path / "test_env_a.py").write_text(
        "import os\n"
        "def test_sets():\n"
        "    os.environ['VLLM_LOGGING_LEVEL'] = 'ERROR'\n"
        "    os.environ['KEPT'] = 'changed'\n"
        "    del os.environ['GONE']\n"
        "def test_the_module_keeps_it():\n"
        "    assert os.environ['VLLM_LOGGING_LEVEL'] == 'ERROR' and 'GONE' not in os.environ\n")
    (tmp_path / "test_env_b.py").write_text(
        "import os\n"
        "def test_the_next_module_sees_it_as_it_was():\n"
        "    assert 'VLLM_LOGGING_LEVEL' not in os.environ\n"
        "    assert os.environ['KEPT'] == 'before' and os.environ['GONE'] == 'back'\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**env, "KEPT": "before", "GONE": "back"})
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout + r.stderr
