"""Fresh virtual environments for the packaging and tutorial tests.

A fresh environment starts with two read-only layers on its path (a `.pth` file), so that no
test copies torch or resolves the same packages again for every environment:
- torch: links to this interpreter's torch and the packages torch itself requires, so pip sees
  torch as installed and never fetches a (CUDA) build;
- core's dependencies: exactly what pip installs for the built `weightsync-core` wheel without
  extras (resolved once per session from the package index, in an environment of its own).
Everything else (core and the plugin themselves, a plugin's own dependencies, extras) pip
installs into the environment from the built wheels, git or the index. A pip failure caused by
an unreachable index skips the test with that reason; any other failure fails it."""

from __future__ import annotations

import importlib.metadata as md
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
import zipfile
from collections.abc import Callable, Iterator, Sequence
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = {tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]: d.relative_to(ROOT).as_posix()
         for d in [ROOT / "core", *sorted((ROOT / "plugins").iterdir())] if (d / "pyproject.toml").exists()}
# what pip prints when it cannot reach an index (as opposed to a resolution or build failure)
OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                     r"Network is unreachable|ConnectTimeoutError|ProxyError")
CLEAN_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "WEIGHTSYNC_PLUGINS",
             "WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD", "WEIGHTSYNC_TRACE_PLUGINS")


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0]


@pytest.fixture(scope="session")
def scratch() -> Iterator[Callable[[str], Path]]:
    """`scratch(name)`: a new directory for this session's environments, builds and clones, in
    a temporary directory of its own (not pytest's, which other pytest runs on the machine may
    clean up), removed after the session."""
    root = tempfile.mkdtemp(prefix="weightsync-fresh-")
    count = itertools.count()
    yield lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-{next(count)}-", dir=root))
    # thousands of small files: removed in the background rather than on the session's clock
    subprocess.Popen(["rm", "-rf", root], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def torch_base(scratch: Callable[[str], Path]) -> Path:
    """A directory of symlinks to this interpreter's torch and its requirements, for `.pth`."""
    base = scratch("torch-base")
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        name = _requirement_name(todo.pop())
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue                       # a requirement for another platform or Python
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
        site = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top.startswith("..") or top == "__pycache__" or top.endswith(".pth"):
                continue
            if not (base / top).exists():
                (base / top).symlink_to(site / top)
    return base


class FreshEnv:
    """One virtual environment with read-only layers on its path (see the module docstring);
    commands run as if it were activated."""

    def __init__(self, path: Path, layers: Sequence[Path], *, with_pip: bool) -> None:
        self.path = path
        self.with_pip = with_pip
        venv.EnvBuilder(with_pip=with_pip, clear=True).create(path)
        self.bin = path / "bin"
        self.python = self.bin / "python"
        self.site = Path(subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True).stdout.strip())
        (self.site / "_weightsync_test_layers.pth").write_text("".join(f"{p}\n" for p in layers))
        self.env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
        self.env.update(VIRTUAL_ENV=str(path), PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                        PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def pip(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`pip ARGS` for this environment (this environment's pip, or ours pointed at it)."""
        cmd = ([str(self.python), "-m", "pip"] if self.with_pip
               else [sys.executable, "-m", "pip", "--python", str(self.python)])
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        pip_ok(r, "pip " + " ".join(args))
        return r

    @staticmethod
    def check_pip(r: subprocess.CompletedProcess, what: str) -> None:
        """Skip when pip could not reach the index; fail on any other pip error."""
        pip_ok(r, what)

    def run(self, args: Sequence[str] | str, *, cwd: Path | None = None, timeout: float = 300,
            merge: bool = False, **env: str) -> subprocess.CompletedProcess:
        """A command (argv, or a bash line) with this environment activated; `merge` sends
        stderr into stdout, in the order a terminal would show them."""
        cmd = ["bash", "-c", args] if isinstance(args, str) else list(args)
        return subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True, timeout=timeout,
                              stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                              env={**self.env, **env})


def pip_ok(r: subprocess.CompletedProcess, what: str) -> None:
    """Skip when pip could not reach the index; fail on any other pip error."""
    if r.returncode == 0:
        return
    out = (r.stdout or "") + (r.stderr or "")
    if OFFLINE.search(out):
        pytest.skip(reason=f"`{what}` could not reach the package index: {OFFLINE.search(out).group(0)}")
    raise AssertionError(f"`{what}` failed (exit {r.returncode}):\n{out[-6000:]}")


@pytest.fixture(scope="session")
def core_deps(scratch: Callable[[str], Path], torch_base: Path, built: dict) -> Path:
    """The site-packages of an environment holding exactly weightsync-core's dependencies (no
    extras), as pip resolves them for the built wheel, and not core itself."""
    env = FreshEnv(scratch("core-deps") / "venv", [torch_base], with_pip=False)
    with zipfile.ZipFile(built["weightsync-core"]["wheel"]) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist") or []
    env.pip("install", *[r for r in requires if "extra ==" not in r])
    return env.site


@pytest.fixture(scope="session")
def fresh_env(scratch: Callable[[str], Path], torch_base: Path,
              core_deps: Path) -> Callable[..., FreshEnv]:
    """`fresh_env(name, with_pip=False)` makes a new environment."""
    def make(name: str, *, with_pip: bool = False) -> FreshEnv:
        return FreshEnv(scratch(name) / "venv", [torch_base, core_deps], with_pip=with_pip)
    return make


@pytest.fixture(scope="session")
def git_mirror(scratch: Callable[[str], Path]) -> Path:
    """This working tree (tracked and new files, as `git add -A` would take them) committed into
    a throwaway repository named `weightsync`: what `git clone` or a `git+` URL would fetch from
    the project's GitHub repository once this tree is pushed."""
    if shutil.which("git") is None:
        pytest.skip(reason="git is not installed")
    repo = scratch("git-mirror") / "weightsync"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / rel, follow_symlinks=False)
    git = ["git", "-c", "user.name=weightsync tests", "-c", "user.email=tests@weightsync.invalid",
           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "working tree"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    return repo


@pytest.fixture(scope="session")
def built(scratch: Callable[[str], Path]) -> dict[str, dict[str, Path]]:
    """Each distribution's sdist, and its wheel built from that sdist (`python -m build`)."""
    out = scratch("dist")
    isolation = ["--no-isolation"] if _has("hatchling") else []   # no index needed to build
    result: dict[str, dict[str, Path]] = {}
    for dist, rel in DISTS.items():
        target = out / dist
        r = subprocess.run([sys.executable, "-m", "build", *isolation, "--outdir", str(target),
                            str(ROOT / rel)], capture_output=True, text=True, timeout=600)
        pip_ok(r, f"python -m build {rel}")
        sdists, wheels = sorted(target.glob("*.tar.gz")), sorted(target.glob("*.whl"))
        assert len(sdists) == 1 and len(wheels) == 1, (dist, sdists, wheels)
        result[dist] = {"sdist": sdists[0], "wheel": wheels[0]}
    return result


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
