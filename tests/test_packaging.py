"""Packaging: every distribution declares what it imports and nothing more, carries its license,
`py.typed`, metadata and one version source, builds to a wheel and an sdist that pass
`twine check`, and installs alone into a fresh virtual environment where every module imports
and its commands run. Docs and docstrings point only at files inside the repository."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
ORG_URL = "https://github.com/weightsync/weightsync"   # the project's home (placeholder org)
DISTS = {                                   # distribution -> its directory in the repository
    "weightsync-core": "core",
    "weightsync-disk-delta": "plugins/disk_delta",
    "weightsync-sglang": "plugins/sglang",
    "weightsync-vllm": "plugins/vllm",
    "weightsync-lmdeploy": "plugins/lmdeploy",
    "weightsync-bench": "plugins/bench",
    "weightsync-ray": "plugins/ray",
    "weightsync-rl": "plugins/rl",
    "weightsync-reference": "plugins/reference",
    "weightsync-megatron": "plugins/megatron",
    "weightsync-nixl": "plugins/nixl",
}
PACKAGES = {dist: "weightsync" if dist == "weightsync-core" else dist.replace("-", "_")
            for dist in DISTS}
IMPORT_TO_DIST = {"yaml": "pyyaml", "weightsync": "weightsync-core", "megatron": "megatron-core"}
# imports a distribution may make without declaring them, and why
UNDECLARED_OK = {
    "weightsync-core": {
        "triton": "ships with CUDA builds of torch; weightsync.wire.mlh uses torch ops without it",
        "peft": "the LoRA exporter imports it only for a model that is already a PEFT model",
        "transformers": "the exporter's checkpoint layout imports it only for a model that is "
                        "already a transformers model",
    },
    "weightsync-vllm": {
        "vllm": "the engine: imported only inside vLLM's own processes (backend, vllm_plugin)",
        "transformers": "weightsync_vllm.testing builds a model for a live vLLM, which brings it",
        "tokenizers": "weightsync_vllm.testing builds a tokenizer for a live vLLM, which brings it",
    },
}
# requirements a distribution needs at run time without importing them, and why
USED_UNIMPORTED = {
    "weightsync-nixl": {"nixl": "imported by name on first use (weightsync_nixl.loader)",
                        "weightsync-reference": "its tests start reference engines by command"},
    "weightsync-rl": {
        "tensorboard": "torch.utils.tensorboard imports it (weightsync_rl.metrics)",
        "weightsync-reference": "the demo's default engine, started by its adapter kind, never imported",
    },
}
# engines a plugin's modules may import at module level: those modules load only in the engine
ENGINES = {"weightsync-sglang": "sglang", "weightsync-vllm": "vllm", "weightsync-lmdeploy": "lmdeploy"}


def project(dist: str) -> dict:
    return tomllib.loads((ROOT / DISTS[dist] / "pyproject.toml").read_text())


def requirements(dist: str) -> dict[str, str]:
    """Declared requirement name -> where ("dependencies" or "extra NAME")."""
    proj = project(dist)["project"]
    out = {Requirement(r).name.lower(): "dependencies" for r in proj.get("dependencies", [])}
    for extra, reqs in proj.get("optional-dependencies", {}).items():
        for r in reqs:
            out.setdefault(Requirement(r).name.lower(), f"extra {extra}")
    return out


def imports(dist: str) -> dict[str, list[str]]:
    """Top-level names of third-party modules the distribution's source imports -> where (not
    those under `if TYPE_CHECKING:`, which never run)."""
    src = ROOT / DISTS[dist] / "src" / PACKAGES[dist]
    found: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                       for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != PACKAGES[dist]:
                    found.setdefault(top, []).append(f"{path.relative_to(src)}:{node.lineno}")
    return found


def version_of(dist: str) -> str:
    """The version in the one file hatch reads it from."""
    proj = project(dist)
    assert proj["project"].get("dynamic") == ["version"] and "version" not in proj["project"], dist
    path = ROOT / DISTS[dist] / proj["tool"]["hatch"]["version"]["path"]
    m = re.search(r'^__version__ = "([^"]+)"', path.read_text(), re.M)
    assert m, f"{path} has no __version__"
    return m.group(1)


# -- static checks (fast) ----------------------------------------------------------------------

@pytest.mark.parametrize("dist", DISTS)
def test_every_import_is_declared(dist: str) -> None:
    declared = requirements(dist)
    allowed = UNDECLARED_OK.get(dist, {})
    missing = {top: where for top, where in imports(dist).items()
               if IMPORT_TO_DIST.get(top, top.replace("_", "-")).lower() not in declared
               and top not in allowed}
    assert not missing, f"{dist} imports these without declaring them: {missing}"


@pytest.mark.parametrize("dist", DISTS)
def test_nothing_declared_is_unused(dist: str) -> None:
    used = {IMPORT_TO_DIST.get(top, top.replace("_", "-")).lower() for top in imports(dist)}
    unused = {name: where for name, where in requirements(dist).items()
              if name not in used and name not in USED_UNIMPORTED.get(dist, {})}
    if dist == "weightsync-core" and not (ROOT / "core/src/weightsync/ray").exists():
        unused.pop("ray", None)   # the `ray` extra is the install name of the coming weightsync_ray
    assert not unused, f"{dist} declares requirements its code never imports: {unused}"


def test_numba_is_an_extra() -> None:
    """The compiled loops have a numpy/torch path beside them, so numba is never required."""
    core, disk_delta = requirements("weightsync-core"), requirements("weightsync-disk-delta")
    assert core["numba"] == core["llvmlite"] == disk_delta["numba"] == "extra fast"
    fast = project("weightsync-disk-delta")["project"]["optional-dependencies"]["fast"]
    assert any(Requirement(r).name == "weightsync-core" and Requirement(r).extras == {"fast"}
               for r in fast), fast
    assert "zstandard" not in core


@pytest.mark.parametrize("dist", DISTS)
def test_requires_python_311(dist: str) -> None:
    """config.py imports tomllib (3.11), so no distribution may claim an older Python."""
    assert project(dist)["project"]["requires-python"] == ">=3.11"


def test_one_version_source_per_distribution_and_pins_that_fit() -> None:
    versions = {dist: version_of(dist) for dist in DISTS}
    core = Version(versions["weightsync-core"])
    import weightsync
    assert weightsync.__version__ == str(core)
    for dist in DISTS:
        if dist == "weightsync-core":
            continue
        pins = [Requirement(r) for r in project(dist)["project"]["dependencies"]
                if Requirement(r).name == "weightsync-core"]
        assert len(pins) == 1 and core in pins[0].specifier, f"{dist} pins core to {pins}"


@pytest.mark.parametrize("dist", DISTS)
def test_metadata_license_and_py_typed(dist: str) -> None:
    root_license = (ROOT / "LICENSE").read_text()
    assert "Apache License" in root_license and "Version 2.0, January 2004" in root_license
    here = ROOT / DISTS[dist]
    assert (here / "LICENSE").read_text() == root_license
    assert (here / "src" / PACKAGES[dist] / "py.typed").is_file()
    proj = project(dist)["project"]
    assert proj["license"] == "Apache-2.0"
    assert not re.fullmatch(r"weightsync plugin: \w+", proj["description"]), proj["description"]
    assert "Typing :: Typed" in proj["classifiers"]
    assert "Programming Language :: Python :: 3.11" in proj["classifiers"]
    assert all(url.startswith(ORG_URL) for url in proj["urls"].values()), proj["urls"]
    assert {"Homepage", "Repository", "Issues", "Changelog"} <= set(proj["urls"])


def test_changelog_starts_with_this_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", text, re.M)
    assert first and first.group(1) == version_of("weightsync-core")


def _repo_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    keep = {".md", ".py", ".toml", ".yaml", ".yml", ".txt", ".cfg", ""}
    return [ROOT / p for p in listed if p and (ROOT / p).is_file() and Path(p).suffix in keep
            and Path(p).name != "LICENSE"]


# paths of the developers' own notes, which users never have (spelled in pieces so that this
# file is not itself a pointer at them)
_NOTES = "|".join(["shared" + "/reference", r"\.\./" + "shared", r"engine-protocols\.md", r"vllm-on-cpu\.md",
                   r"plugin-conventions\.md", r"DESIGN\.md", "release note"])
OUTSIDE = re.compile(_NOTES, re.I)


def test_nothing_points_outside_the_repository() -> None:
    hits = []
    for path in _repo_text_files():
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_markdown_links_stay_inside_and_exist() -> None:
    bad = []
    for path in _repo_text_files():
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
    assert not bad, "links that leave the repository or lead nowhere:\n" + "\n".join(bad)


def test_contract_kit_loads_pytest_only_for_the_contracts() -> None:
    """`weightsync.testing` and its sample weights import with pytest blocked; the contract
    classes then say which extra brings it."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import weightsync.testing as t\n"
            "from weightsync.testing import perturb, sample_state_dict\n"
            "import weightsync.testing.sample\n"
            "try:\n    t.EncodingContract\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "weightsync-core[testing]" in r.stdout
    from weightsync.testing import AdapterContract, EncodingContract, ExporterContract
    assert {c.__module__ for c in (AdapterContract, EncodingContract, ExporterContract)} \
        == {"weightsync.testing.contracts"}


# -- wheels and sdists -------------------------------------------------------------------------

@pytest.mark.slow
def test_wheels_and_sdists_build_and_pass_twine_check(built: dict) -> None:
    assert set(built) == set(DISTS)
    files = [str(p) for d in built.values() for p in d.values()]
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for dist, paths in built.items():
        package, version = PACKAGES[dist], version_of(dist)
        with zipfile.ZipFile(paths["wheel"]) as whl:
            names = whl.namelist()
            info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        assert meta["Name"] == dist and meta["Version"] == version
        assert meta["Requires-Python"] == ">=3.11"
        assert meta["License-Expression"] == "Apache-2.0"
        assert f"{info}/licenses/LICENSE" in names
        assert f"{package}/py.typed" in names
        assert meta.get_all("Classifier") and meta.get_all("Project-URL")
        assert not re.fullmatch(r"weightsync plugin: \w+", meta["Summary"])
        with tarfile.open(paths["sdist"]) as sdist:
            members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
        assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO", f"src/{package}/py.typed"} <= members


# -- each distribution alone in a fresh environment -------------------------------------------

IMPORT_ALL = r"""
import importlib, importlib.metadata as md, json, re, sys
from pathlib import Path
dist, package, engine = sys.argv[1], sys.argv[2], sys.argv[3]
extras = {}
for req in md.requires(dist) or []:
    m = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
    if m:
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("-", "_")
        extras.setdefault(name, m.group(1))
root = Path(importlib.import_module(package).__file__).parent
mods = sorted({".".join((package, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
               for p in root.rglob("*.py") if p.stem != "__main__"})
done, skipped, failed = [], {}, {}
for mod in mods:
    try:
        importlib.import_module(mod)
        done.append(mod)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in extras:
            skipped[mod] = f"needs the '{extras[top]}' extra ({top})"
        elif top and top == engine:
            skipped[mod] = f"imports {top}: loaded only inside the engine's processes"
        else:
            failed[mod] = repr(e)
    except Exception as e:
        failed[mod] = repr(e)
print(json.dumps({"imported": done, "skipped": skipped, "failed": failed}))
"""


def import_all(env, dist: str) -> dict:
    r = env.run([str(env.python), "-c", IMPORT_ALL, dist, PACKAGES[dist], ENGINES.get(dist, "")])
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert not result["failed"], f"{dist}: modules that fail to import: {result['failed']}"
    assert len(result["imported"]) > 1, result
    return result


def plugins_json(env) -> dict[str, dict]:
    r = env.run(["weightsync", "plugins", "--json"])
    assert r.returncode == 0, r.stderr[-4000:]
    return {row["name"]: row for row in json.loads(r.stdout)}


def run_ok(env, *args: str) -> str:
    r = env.run(list(args))
    assert r.returncode == 0, f"{' '.join(args)}: {r.stderr[-4000:]}"
    return r.stdout


PLUGIN_COMPONENTS = {
    "weightsync-disk-delta": ("disk_delta", {"transport:disk_delta", "encoding:delta"}),
    "weightsync-sglang": ("sglang", {"adapter:sglang", "transport:sglang_tensor"}),
    "weightsync-vllm": ("vllm", {"adapter:vllm"}),
    "weightsync-lmdeploy": ("lmdeploy", {"adapter:lmdeploy", "transport:lmdeploy_ipc"}),
    "weightsync-bench": ("bench", set()),
    "weightsync-ray": ("ray", {"fleet:ray"}),
    "weightsync-rl": ("rl", set()),
    "weightsync-reference": ("reference", {"adapter:reference"}),
    "weightsync-megatron": ("megatron", {"exporter:megatron"}),
    "weightsync-nixl": ("nixl", {"transport:nixl", "peer_source:nixl"}),
}


def install_alone(key: str, env, built: dict, git_mirror: Path) -> None:
    """What a user installs: core alone, or one plugin with core (no other plugin, no engine);
    `weightsync-disk-delta[fast]` adds the extra. The SGLang plugin comes from git URLs, as its
    README says; the others from the built wheels."""
    if key == "weightsync-sglang":
        url = f"git+file://localhost{git_mirror}"    # pip wants a host in a git+file URL
        env.pip("install", f"weightsync-core @ {url}#subdirectory=core",
                f"weightsync-sglang @ {url}#subdirectory=plugins/sglang")
    else:
        dist, _, extra = key.partition("[")
        env.pip("install", str(built["weightsync-core"]["wheel"]),
                *[str(built[d]["wheel"]) for d in weightsync_requirements(dist)],
                str(built[dist]["wheel"]) + (f"[{extra}" if extra else ""))
    env.pip("check")


def weightsync_requirements(dist: str) -> list[str]:
    """The other weightsync distributions `dist` requires (not core), and theirs, from their
    built wheels: they are not on the package index."""
    out: list[str] = []
    for r in project(dist)["project"]["dependencies"]:
        name = Requirement(r).name
        if name in DISTS and name != "weightsync-core" and name not in out:
            out += [d for d in weightsync_requirements(name) if d not in out] + [name]
    return out


@pytest.fixture(scope="module")
def alone(built: dict, fresh_env, git_mirror: Path) -> dict:
    """One fresh environment per distribution (and one for disk_delta's `fast` extra), installed
    in parallel: pip mostly waits on the index. Maps each to its env, or the exception its
    install raised (a skip included), for that distribution's test to raise."""
    keys = [*DISTS, "weightsync-disk-delta[fast]"]
    envs = {key: fresh_env("alone-" + re.sub(r"\W", "-", key)) for key in keys}

    def setup(key: str):
        try:
            install_alone(key, envs[key], built, git_mirror)
            return envs[key]
        except BaseException as e:                  # noqa: BLE001 - re-raised in the test
            return e

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(keys, pool.map(setup, keys)))


def env_of(alone: dict, key: str):
    env = alone[key]
    if isinstance(env, BaseException):
        raise env
    return env


@pytest.mark.slow
@pytest.mark.parametrize("dist", DISTS)
def test_installs_alone_imports_everything_and_runs_its_commands(dist: str, alone: dict) -> None:
    env = env_of(alone, dist)
    result = import_all(env, dist)
    rows = plugins_json(env)
    assert not [r for r in rows.values() if r.get("error")], rows
    others = {name for name, _ in PLUGIN_COMPONENTS.values()} - {PLUGIN_COMPONENTS.get(dist, ("",))[0]} \
        - {PLUGIN_COMPONENTS[d][0] for d in weightsync_requirements(dist)}
    assert not others & set(rows), f"other plugins leaked into the environment: {set(rows)}"
    if dist == "weightsync-core":
        assert "usage" in run_ok(env, "weightsync", "--help").lower()
        assert "usage" in run_ok(env, "python", "-m", "weightsync", "--help").lower()
        assert "testing" in result["skipped"].get("weightsync.testing.contracts", ""), result
        assert run_ok(env, "python", "-c", CORE_JIT_PROBE).strip() == "False"   # torch path
        return
    name, components = PLUGIN_COMPONENTS[dist]
    assert components <= set(rows[name]["components"]), rows[name]
    assert rows[name]["version"] == version_of(dist)
    if dist == "weightsync-rl":
        assert "--steps" in run_ok(env, "weightsync", "demo", "--help")
        assert "--fleet" in run_ok(env, "weightsync", "route", "--help")
    if dist == "weightsync-reference":
        assert "--load-root" in run_ok(env, "weightsync", "serve", "--help")
    if dist == "weightsync-bench":
        assert "--receivers" in run_ok(env, "weightsync", "bench", "--help")
    if dist == "weightsync-disk-delta":
        assert "usage" in run_ok(env, "weightsync-disk-delta", "--help").lower()
        assert "usage" in run_ok(env, "weightsync-disk-delta", "agent", "--help").lower()
        assert run_ok(env, "python", "-c", JIT_PROBE).strip() == "False"   # numpy path by default
        assert "fast" in result["skipped"].get("weightsync_disk_delta._jit", ""), result


JIT_PROBE = "from weightsync_disk_delta import kernels; print(kernels.jit() is not None)"
CORE_JIT_PROBE = "from weightsync.wire import digests; print(digests.jit() is not None)"


@pytest.mark.slow
def test_disk_delta_fast_extra_brings_the_compiled_kernels(alone: dict) -> None:
    env = env_of(alone, "weightsync-disk-delta[fast]")
    assert "weightsync_disk_delta._jit" in import_all(env, "weightsync-disk-delta")["imported"]
    assert run_ok(env, "python", "-c", JIT_PROBE).strip() == "True"
    assert run_ok(env, "python", "-c", CORE_JIT_PROBE).strip() == "True"   # core[fast] came along
