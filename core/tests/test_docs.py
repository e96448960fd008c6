"""docs/writing-plugins.md works as written: its code blocks are the files under docs/examples/,
the example plugin installs with pip, `weightsync plugins` lists it, its config checks, and its
contract tests pass against real reference-engine processes that load it by entry point."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightsync.testing import sample_state_dict, write_weights_only_model

from weightsync_reference.processes import EngineProcess

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
TUTORIAL = DOCS / "writing-plugins.md"
IGNORED = {"__pycache__", ".pytest_cache", "build", "dist"}

FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", re.S)
PLUGINS_BLOCK = re.compile(r"<!-- plugins-json: (\S+) -->\n```json\n(.*?)```\n", re.S)
CHECK_BLOCK = re.compile(r"<!-- check: (\S+) -->\n```console\n\$ (.*?)\n(.*?)```\n", re.S)


def tutorial() -> str:
    return TUTORIAL.read_text()


def example_files() -> dict[str, str]:
    out = {}
    for p in sorted(EXAMPLES.rglob("*")):
        rel = p.relative_to(EXAMPLES)
        if p.is_file() and not any(part in IGNORED or part.endswith(".egg-info")
                                   or part.startswith(".") for part in rel.parts):
            out[rel.as_posix()] = p.read_text()
    return out


def test_tutorial_blocks_are_the_example_files() -> None:
    blocks = dict(FILE_BLOCK.findall(tutorial()))
    files = example_files()
    assert sorted(blocks) == sorted(files), "every example file is shown once in the tutorial"
    for name, text in files.items():
        assert blocks[name] == text, f"writing-plugins.md's block for {name} differs from the file"


def test_pyproject_is_small_and_names_the_entry_point() -> None:
    text = (EXAMPLES / "weightsync-echo" / "pyproject.toml").read_text()
    assert len(text.splitlines()) <= 15
    assert '[project.entry-points.weightsync]\necho = "weightsync_echo.plugin"' in text
    assert "sglang" not in text and "vllm" not in text and "lmdeploy" not in text


# -- the example, really installed ------------------------------------------------------------

@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | dict[str, str]]:
    """The example copied out of the repository (so nothing is written into docs/) and installed
    with pip into a --target directory; `env` puts that directory on every child's path."""
    work = tmp_path_factory.mktemp("tutorial")
    src = work / "weightsync-echo"
    shutil.copytree(EXAMPLES / "weightsync-echo", src, ignore=shutil.ignore_patterns(*IGNORED))
    for extra in ("echo-sync.yaml", "push_echo.py"):
        shutil.copy(EXAMPLES / extra, work / extra)
    site = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--target", str(site), str(src)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(4, "--no-build-isolation")   # no index needed; otherwise pip fetches hatchling
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip could not install the example plugin:\n{r.stdout}\n{r.stderr}"
    assert (site / "weightsync_echo" / "plugin.py").exists()
    env = {k: v for k, v in os.environ.items()
           if k not in ("WEIGHTSYNC_PLUGINS", "WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD",
                        "WEIGHTSYNC_TRACE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return {"work": work, "src": src, "site": site, "env": env}


def run(installed: dict, *args: str, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=installed["work"], capture_output=True,
                          text=True, timeout=timeout, env={**installed["env"], **env})


def test_weightsync_plugins_lists_echo_as_the_tutorial_shows(installed: dict) -> None:
    r = run(installed, "-m", "weightsync", "plugins", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    shown = dict(PLUGINS_BLOCK.findall(tutorial()))
    assert set(shown) == {"echo"}
    assert rows["echo"] == json.loads(shown["echo"])
    assert "transport:http" in rows["weightsync.builtin"]["components"]


def test_tutorial_config_checks_and_traces(installed: dict) -> None:
    """Step 6's `weightsync check` and the trace shown under "Controlling which plugins load",
    from one run (the trace goes to stderr, the check's answer to stdout)."""
    (config, command, output), = CHECK_BLOCK.findall(tutorial())
    assert command == f"weightsync check --offline {config}"
    trace = re.search(rf"```console\n\$ WEIGHTSYNC_TRACE_PLUGINS=1 WEIGHTSYNC_PLUGINS=echo,reference "
                      rf"{command}\n(.*?)```", tutorial(), re.S)
    assert trace is not None
    r = run(installed, "-m", "weightsync", "check", "--offline", config,
            WEIGHTSYNC_TRACE_PLUGINS="1", WEIGHTSYNC_PLUGINS="echo,reference")
    assert r.returncode == 0, r.stderr
    assert r.stdout == output
    traced = [line for line in r.stderr.splitlines() if line.startswith("weightsync: register_")]
    assert "\n".join(traced) + "\n" + r.stdout == trace.group(1)


def test_example_contract_tests_pass(installed: dict) -> None:
    """What step 7 shows: the example's own pytest run, engines included, all passing."""
    r = run(installed, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            str(installed["src"] / "tests"),
            timeout=300, WEIGHTSYNC_PLUGINS="echo,reference")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    want = re.search(r"^(\d+) passed in", tutorial(), re.M)
    assert want is not None and re.match(rf"{want.group(1)} passed in [0-9.]+s", summary), summary


def test_push_script_moves_weights_through_files(installed: dict, tmp_path: Path) -> None:
    """Step 8 with the engine on a free port: two versions land bit-exact and verified."""
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "my-model", sd)
    env = {"PYTHONPATH": installed["env"]["PYTHONPATH"], "WEIGHTSYNC_PLUGINS": "echo,reference"}
    with EngineProcess(model, log=tmp_path / "engine.log", env=env) as engine:
        config = (installed["work"] / "echo-sync.yaml").read_text()
        assert "http://127.0.0.1:8100" in config and "/tmp/weightsync-echo" in config
        config = config.replace("http://127.0.0.1:8100", engine.url).replace(
            "/tmp/weightsync-echo", str(tmp_path / "echo"))
        (tmp_path / "sync.yaml").write_text(config)
        r = run(installed, "push_echo.py", str(tmp_path / "sync.yaml"),
                str(model / "model.safetensors"), WEIGHTSYNC_PLUGINS="echo,reference")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert [line.split(":")[0] for line in lines] == ["v1", "v2"]
        assert all(line.endswith("1/1 engines (1 verified)") for line in lines), r.stdout
        assert engine.health()["version"] == 2
        got = engine.weights()
    want = load_file(str(model / "model.safetensors"))
    for name, t in want.items():
        expected = (t + 1) + 1 if t.is_floating_point() else t   # the script adds 1 per version
        assert torch.equal(got[name], expected), name
    assert list((tmp_path / "echo").iterdir()) == [], "echo leaves no payload files behind"


# -- docs/transports.md against the installed plugins (in-process, no engines) -----------------

TRANSPORTS = DOCS / "transports.md"


@pytest.fixture(scope="module")
def everything():
    """Every installed plugin's components (entry points included), as a user would have them."""
    from weightsync.plugins import load_components
    return load_components()


def _table(marker: str) -> list[list[str]]:
    """The rows (cells without backticks) of the markdown table right after `<!-- marker -->`."""
    m = re.search(rf"<!-- {re.escape(marker)} -->\n((?:\|.*\n)+)", TRANSPORTS.read_text())
    assert m is not None, f"docs/transports.md has no table marked {marker!r}"
    rows = [[c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
            for line in m.group(1).splitlines()]
    return rows[2:]   # header and separator


def _cells(text: str) -> set[str]:
    return {c.strip() for c in text.split(",")} - {"", "-"}


def test_transport_matrix_matches_requires_and_messages(everything) -> None:
    from weightsync.sync.assembly import missing as lacks
    rows = _table("transport-matrix")
    shown = {r[0] for r in rows}
    missing = set(everything.transports.names()) - {"echo"} - shown
    assert not missing, f"installed transports missing from the matrix: {missing}"
    adapters = dict(everything.adapters.items())
    checked = 0
    for name, requires, messages, listed in rows:
        if name not in everything.transports:
            continue   # its plugin is not installed here; the other rows still count
        cls = everything.transports.get(name)
        assert {c.__name__ for c in cls.requires} == _cells(requires), name
        assert {m.kind for m in cls.messages} == _cells(messages), name
        can = {a for a, acls in adapters.items() if not lacks(acls, cls)}
        assert can == _cells(listed) & set(adapters), f"{name}: adapters that can use it"
        checked += 1
    assert checked >= 3   # http, shm and collective are core


@pytest.mark.parametrize("transport", ["http", "shm", "collective", "disk_delta"])
def test_transport_options_tables_match_options_models(everything, transport: str) -> None:
    if transport not in everything.transports:
        pytest.skip(reason=f"transport {transport!r} is not installed in this environment")
    fields = everything.transports.get(transport).Options.model_fields
    rows = {r[0]: r[1] for r in _table(f"options: {transport}")}
    assert sorted(rows) == sorted(fields)
    for name, default in rows.items():
        f = fields[name]
        if default == "required":
            assert f.is_required(), name
        else:
            assert json.loads(default) == f.default, f"{transport}.{name}: default {default}"


def test_transport_config_snippets_resolve(everything) -> None:
    from weightsync.sync.assembly import resolve
    from weightsync.config import SyncConfig
    import yaml
    blocks = re.findall(r"<!-- check-config -->\n```yaml\n(.*?)```", TRANSPORTS.read_text(), re.S)
    assert len(blocks) == 4
    for block in blocks:
        data = yaml.safe_load(block)
        kinds = [data["transport"]["kind"], data.get("encoding", {}).get("kind", "raw")]
        if not all(k in everything.transports or k in everything.encodings for k in kinds):
            continue   # a plugin of this snippet is not installed here
        resolved = resolve(SyncConfig.load(data), everything)
        assert resolved.transport_cls.name == data["transport"]["kind"]


def test_readme_layout_names_every_part_of_core() -> None:
    """README's layout block names every module and subpackage of core (it drifted once)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    src = ROOT / "core/src/weightsync"
    parts = sorted(p.name + ("/" if p.is_dir() else "") for p in src.iterdir()
                   if p.name not in ("__init__.py", "__main__.py", "py.typed", "__pycache__"))
    missing = [p for p in parts if not re.search(rf"(^|[\s,(]){re.escape(p.rstrip('/'))}\b", block)]
    assert not missing, f"README's layout block does not mention {missing}"


def _readme_table(text: str, head: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header line starts with `head`."""
    lines = text[text.index(head):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


DIST_DIRS = {"weightsync-core": "core", "weightsync-disk-delta": "plugins/disk_delta",
             "weightsync-sglang": "plugins/sglang", "weightsync-vllm": "plugins/vllm",
             "weightsync-lmdeploy": "plugins/lmdeploy", "weightsync-bench": "plugins/bench",
             "weightsync-ray": "plugins/ray", "weightsync-rl": "plugins/rl",
             "weightsync-reference": "plugins/reference", "weightsync-megatron": "plugins/megatron",
             "weightsync-nixl": "plugins/nixl"}


def test_readme_extras_table_matches_the_pyprojects() -> None:
    """Every extra README names exists and adds what the row says; every core extra is listed."""
    import tomllib

    from packaging.requirements import Requirement
    extras = {d: tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"]
              .get("optional-dependencies", {}) for d, p in DIST_DIRS.items()}
    listed: set[tuple[str, str]] = set()
    for extra_cell, adds, _ in _readme_table((ROOT / "README.md").read_text(), "| extra | adds |"):
        if extra_cell == "none":
            continue
        for dist, extra in re.findall(r"`([\w-]+)\[(\w+)\]`", extra_cell):
            assert extra in extras[dist], f"README lists {dist}[{extra}], which does not exist"
            names = {Requirement(r).name.lower() for r in extras[dist][extra]}
            said = {a.strip().lower() for a in adds.split(",") if a.strip()}
            assert said <= names, f"README says {dist}[{extra}] adds {said}; it adds {names}"
            listed.add((dist, extra))
    core = {("weightsync-core", e) for e in extras["weightsync-core"]}
    assert core <= listed, f"core extras missing from README's table: {sorted(core - listed)}"


def test_readme_components_table_is_what_is_registered() -> None:
    """README's component table lists exactly the components core and the plugins register,
    each under the package that registers it."""
    from weightsync.plugins import load_components
    components = load_components()
    assert not components.failed, components.failed
    registered = set()
    for kind in ("exporter", "encoding", "transport", "adapter", "fleet", "peer_source"):
        for name, cls in components.registry(kind).items():
            top = cls.__module__.split(".")[0]
            registered.add((kind.replace("_", " "), name,
                            "core" if top == "weightsync" else top.removeprefix("weightsync_")))
    rows = {(kind, name.strip("`"), package.split()[0])
            for kind, name, package, _ in _readme_table((ROOT / "README.md").read_text(), "| kind | name |")}
    assert rows == registered, (f"in README, not registered: {sorted(rows - registered)}; "
                                f"registered, not in README: {sorted(registered - rows)}")
