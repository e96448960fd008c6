"""The hooks, their docs and the plugin manager's promises (datasette-style meta-tests):
every hook is documented in docs/hooks.md and tested by a `test_hook_<name>`, the doc's examples
run, and loading follows what docs/writing-plugins.md says (allowlist, broken plugins, duplicate
names, misspelt hooks)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pluggy
import pytest

from weightsync_reference import plugin as reference_plugin
from weightsync import hookspecs
from weightsync_reference.adapter import ReferenceAdapter
from weightsync.sync.assembly import resolve
from weightsync.config import SyncConfig
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import ConfigError, PluginError
from weightsync.exporters.torch import TorchExporter
from weightsync.hookspecs import hookimpl
from weightsync.plugins import describe_plugins, load_components, make_plugin_manager
from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync.transports.http.sending import HttpTransport
from weightsync_reference.processes import EngineProcess

ROOT = Path(__file__).resolve().parents[2]
HOOKS_MD = ROOT / "docs" / "hooks.md"
TESTS = Path(__file__).resolve().parent
ENV_VARS = ("WEIGHTSYNC_PLUGINS", "WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD", "WEIGHTSYNC_TRACE_PLUGINS")


def hook_specs() -> dict[str, list[str]]:
    """Hook name -> argument names, read from the hookspec module itself."""
    return {name: list(inspect.signature(fn).parameters)
            for name, fn in vars(hookspecs).items()
            if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")}


HOOKS = sorted(hook_specs())


def doc_sections() -> dict[str, str]:
    """`## heading` -> the text up to the next `## ` heading."""
    parts = re.split(r"^## ", HOOKS_MD.read_text(), flags=re.M)
    return {p.split("\n", 1)[0].strip(): p for p in parts[1:]}


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", HOOKS_MD.read_text(), re.S)


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_the_registration_and_tool_hooks_exist() -> None:
    assert hook_specs() == {"register_adapters": ["register"], "register_encodings": ["register"],
                            "register_exporters": ["register"], "register_transports": ["register"],
                            "register_fleets": ["register"], "register_peer_sources": ["register"],
                            "register_launchers": ["register"],
                            "register_commands": ["subparsers"], "add_hookspecs": ["pluginmanager"]}
    assert HOOKS == sorted(h for h in dir(make_plugin_manager(load_entrypoints=False).hook)
                           if not h.startswith("_"))


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented(hook: str) -> None:
    sections = doc_sections()
    heading = next((h for h in sections if h.startswith(f"{hook}(")), None)
    assert heading is not None, f"docs/hooks.md has no '## {hook}(' heading"
    args = re.fullmatch(rf"{hook}\((.*)\)", heading)
    assert args is not None, heading
    documented = [a.strip() for a in args.group(1).split(",") if a.strip()]
    for arg in hook_specs()[hook]:
        assert arg in documented, f"'## {heading}' does not mention argument {arg!r}"
        assert f"`{arg}" in sections[heading], f"the {hook} section never explains {arg!r}"
    example = f"def {hook}(self, {', '.join(hook_specs()[hook])})"
    assert example in sections[heading], f"the {hook} section has no example"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook: str) -> None:
    pattern = re.compile(rf"^def test_hook_{hook}\(", re.M)
    assert any(pattern.search(p.read_text()) for p in TESTS.rglob("test_*.py")), \
        f"no test_hook_{hook} under core/tests"


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_hooks_md_example_runs(index: int) -> None:
    """Every python block in docs/hooks.md runs as written (its asserts included)."""
    code = python_blocks()[index]
    exec(compile(code, f"docs/hooks.md[block {index}]", "exec"), {"__name__": f"hooks_md_{index}"})


# -- one test per hook: a throwaway class plugin on a fresh manager ---------------------------

def test_hook_register_exporters(tmp_path: Path) -> None:
    """Registered once at assembly; a push of many buckets calls the hook no more."""
    calls = []

    class SmallBuckets(TorchExporter):
        name = "small-buckets"

    class Plugin:
        @hookimpl
        def register_exporters(self, register):
            calls.append(register)
            register(SmallBuckets)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="small-buckets-plugin")
    pm.register(reference_plugin, name="reference")
    components = load_components(pm)
    assert components.exporters.get("small-buckets") is SmallBuckets
    assert "torch" in components.exporters
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), log=tmp_path / "e.log") as e:
        cfg = {"exporter": {"kind": "small-buckets", "options": {"bucket_bytes": 2048}},
               "engines": [e.spec()]}
        from weightsync import WeightSync
        with WeightSync.from_config(cfg, components=components) as sync:
            report = sync.push(sd, version=1)
        assert report.ok and report.verified, report.summary()
        assert report.buckets > 3
        assert e.health()["version"] == 1
    assert len(calls) == 1, "hooks run at assembly only, never per bucket or per sync"


def test_hook_register_encodings() -> None:
    class Raw2(RawEncoding):
        name = "raw2"

    class Raw3(RawEncoding):
        name = "raw3"

    class Plugin:
        @hookimpl
        def register_encodings(self, register):
            register(Raw2)
            register(Raw3)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="raw-variants")
    encodings = load_components(pm).encodings
    assert encodings.get("raw2") is Raw2 and encodings.get("raw3") is Raw3
    assert {"raw", "cast", "raw2", "raw3"} <= set(encodings.names())


def test_hook_register_transports() -> None:
    class PlainFileTransport(HttpTransport):
        name = "plain-file"

    class Plugin:
        @hookimpl
        def register_transports(self, register):
            register(PlainFileTransport)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="plain-file-plugin")
    components = load_components(pm)
    assert components.transports.get("plain-file") is PlainFileTransport
    assert "http" in components.transports
    row = next(r for r in describe_plugins(components) if r["name"] == "plain-file-plugin")
    assert row["hooks"] == ["register_transports"]


def test_hook_register_adapters() -> None:
    class Proxied(ReferenceAdapter):
        name = "proxied"
        group_size = None                    # type: ignore[assignment]  # not JoinsGroups

    class Plugin:
        @hookimpl
        def register_adapters(self, register):
            register(Proxied)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="proxied-plugin")
    components = load_components(pm)
    assert components.adapters.get("proxied") is Proxied
    engines = [{"url": "http://127.0.0.1:8100"}]
    resolved = resolve(SyncConfig.load({"adapter": "proxied", "engines": engines}), components)
    assert resolved.engines[0].adapter_cls is Proxied
    refused = SyncConfig.load({"adapter": "proxied", "transport": "collective", "engines": engines})
    with pytest.raises(ConfigError, match="'proxied' cannot receive over transport 'collective'"):
        resolve(refused, components)


def test_hook_register_launchers(tmp_path: Path) -> None:
    """The reference engine's launcher, found by its adapter's name, starts a real engine on this
    machine that the reference adapter then drives."""
    from weightsync.interfaces import Launcher
    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(reference_plugin, name="reference")
    launcher = load_components(pm).launchers.get("reference")
    assert issubclass(launcher, Launcher)
    env: dict[str, str] = {}
    argv = launcher.start_command("m", "127.0.0.1", 9, "e", {}, env, api_key="k" * 24)
    assert argv[:4] == ["{python}", "-m", "weightsync", "serve"] and env["WEIGHTSYNC_API_KEY"] == "k" * 24
    model = write_weights_only_model(tmp_path / "model", sample_state_dict())
    started = launcher.launch_local(model, tmp_path, "launched")
    try:
        spec = started.spec
        assert ReferenceAdapter(engine=__import__("weightsync").EngineSpec(**spec)).health().version == 0
    finally:
        started.stop()


def test_hook_register_fleets() -> None:
    from weightsync.fleets.static import StaticFleet

    class Fixed(StaticFleet):
        name = "fixed"

    class Plugin:
        @hookimpl
        def register_fleets(self, register):
            register(Fixed)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="fixed-fleet-plugin")
    pm.register(reference_plugin, name="reference")
    components = load_components(pm)
    assert components.fleets.get("fixed") is Fixed
    resolved = resolve(SyncConfig.load({"fleet": "fixed", "engines": [{"url": "http://127.0.0.1:8100"}]}),
                       components)
    assert resolved.fleet_cls is Fixed
    with pytest.raises(PluginError, match="unknown fleet 'nope'; installed: .*registry.*static"):
        resolve(SyncConfig.load({"fleet": "nope", "engines": []}), components)
    with pytest.raises(ConfigError, match="`engines` lists a static fleet, but `fleet` is 'registry'"):
        resolve(SyncConfig.load({"fleet": "registry", "engines": [{"url": "http://127.0.0.1:8100"}]}),
                components)


def test_hook_register_peer_sources() -> None:
    from weightsync.fleets.peer import HttpPeerSource

    class Other(HttpPeerSource):
        name = "other"

    class Plugin:
        @hookimpl
        def register_peer_sources(self, register):
            register(Other)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="other-source-plugin")
    components = load_components(pm)
    assert components.peer_sources.get("other") is Other
    assert components.peer_sources.get("http") is HttpPeerSource
    row = next(r for r in describe_plugins(components) if r["name"] == "other-source-plugin")
    assert row["hooks"] == ["register_peer_sources"]


CMD_PLUGIN = """\
from weightsync import hookimpl


def hello(args):
    print(f"hello, {args.name}")
    return 0


@hookimpl
def register_commands(subparsers):
    sp = subparsers.add_parser("hello", help="say hello")
    sp.add_argument("--name", default="world", help="who to greet")
    sp.set_defaults(fn=hello)
"""

BAD_CMD_PLUGIN = """\
from weightsync import hookimpl


@hookimpl
def register_commands(subparsers):
    subparsers.add_parser("check", help="takes a name core has")
"""


def test_hook_register_commands(tmp_path: Path) -> None:
    """An installed plugin's subcommand runs as `weightsync <name>`; a plugin whose hook fails
    (here: it takes a built-in name) is a warning and the other commands still work."""
    site = tmp_path / "site"
    for ep, package, plugin in (("meta_cmd", "ws_meta_cmd", CMD_PLUGIN),
                                ("meta_badcmd", "ws_meta_badcmd", BAD_CMD_PLUGIN)):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        (site / package / "plugin.py").write_text(plugin)
        info = site / f"weightsync_{ep}-0.1.0.dist-info"
        info.mkdir()
        dist = "weightsync-" + ep.replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[weightsync]\n{ep} = {package}.plugin\n")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])),
               WEIGHTSYNC_PLUGINS="meta_cmd,meta_badcmd", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "weightsync", "hello", "--name", "trainer"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hello, trainer\n"
    assert "weightsync plugin 'meta_badcmd' failed in register_commands" in r.stderr
    assert "conflicting subparser: check" in r.stderr
    r = subprocess.run([sys.executable, "-m", "weightsync", "--help"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "say hello" in r.stdout and "validate a sync config" in r.stdout


def test_hook_add_hookspecs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An application's hook, added through `add_hookspecs` while the manager is built, is
    called on every plugin that implements it; a plugin that implements it optionally loads
    without the application; an `add_hookspecs` that raises is a failed plugin, not a crash."""
    (tmp_path / "app_specs_probe.py").write_text(
        "from weightsync import hookimpl\nfrom weightsync.hookspecs import hookspec\n\n"
        "class Specs:\n    @hookspec\n    def register_greetings(self, register):\n"
        "        pass\n\n"
        "@hookimpl\ndef add_hookspecs(pluginmanager):\n    pluginmanager.add_hookspecs(Specs)\n")
    (tmp_path / "app_user_probe.py").write_text(
        "from weightsync import hookimpl\n\n@hookimpl(optionalhook=True)\n"
        "def register_greetings(register):\n    register('hello')\n")
    (tmp_path / "app_broken_probe.py").write_text(
        "from weightsync import hookimpl\n\n@hookimpl\ndef add_hookspecs(pluginmanager):\n"
        "    raise RuntimeError('broken application')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import weightsync.plugins as plugins_mod
    builtin = plugins_mod.DEFAULT_PLUGINS
    monkeypatch.setattr(plugins_mod, "DEFAULT_PLUGINS", ("app_user_probe", *builtin))
    pm = make_plugin_manager(load_entrypoints=False)        # the user alone: loads
    assert not pm.hook.register_greetings.has_spec()     # pending, and no error
    monkeypatch.setattr(plugins_mod, "DEFAULT_PLUGINS", ("app_specs_probe", "app_user_probe",
                                                         "app_broken_probe", *builtin))
    pm = make_plugin_manager(load_entrypoints=False)
    found: list[str] = []
    pm.hook.register_greetings(register=found.append)
    assert found == ["hello"]
    assert "broken application" in pm.failed_plugins["app_broken_probe"]
    assert pm.get_plugin("app_broken_probe") is None


# -- what `register` refuses ------------------------------------------------------------------

def test_duplicate_component_name_is_an_error_naming_both_modules() -> None:
    class OtherHttp(HttpTransport):
        name = "http"

    class Plugin:
        @hookimpl
        def register_transports(self, register):
            register(OtherHttp)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="clash")
    with pytest.raises(PluginError) as err:
        load_components(pm)
    msg = str(err.value)
    assert "transport 'http' is registered by both" in msg
    assert "weightsync.transports.http.sending.HttpTransport" in msg
    assert f"{OtherHttp.__module__}.{OtherHttp.__qualname__}" in msg
    assert "WEIGHTSYNC_PLUGINS" in msg


def test_register_refuses_what_is_not_a_component() -> None:
    class NoName(HttpTransport):
        name = ""

    class Plugin:
        def __init__(self, cls: type) -> None:
            self.cls = cls

        @hookimpl
        def register_transports(self, register):
            register(self.cls)

    for bad, expected in ((RawEncoding, "is not a Transport"), (NoName, "has no `name`")):
        pm = make_plugin_manager(load_entrypoints=False)
        pm.register(Plugin(bad), name="bad")
        with pytest.raises(PluginError, match=expected):
            load_components(pm)


def test_misspelt_hookimpl_fails_check_pending() -> None:
    class Plugin:
        @hookimpl
        def register_transport(self, register):  # the "s" is missing
            register(HttpTransport)

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="typo")
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'register_transport'"):
        pm.check_pending()


def test_raising_hookimpl_is_recorded_as_failed(caplog: pytest.LogCaptureFixture) -> None:
    class Plugin:
        @hookimpl
        def register_transports(self, register):
            raise RuntimeError("rdma device not found")

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="flaky")
    with caplog.at_level(logging.WARNING, logger="weightsync.plugins"):
        components = load_components(pm)
    assert "rdma device not found" in components.failed["flaky"]
    assert "flaky" in caplog.text and "rdma device not found" in caplog.text
    assert "http" in components.transports
    with pytest.raises(PluginError, match=r"unknown transport 'rdma'.*flaky.*rdma device not"):
        components.transports.get("rdma")


# -- entry-point loading, through real installed distributions --------------------------------

GOOD_PLUGIN = """\
from weightsync import hookimpl


@hookimpl
def register_transports(register):
    from weightsync.transports.http.sending import HttpTransport

    class MetaGoodTransport(HttpTransport):
        name = "meta-good"

    register(MetaGoodTransport)
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Two distributions installed by hand into a directory on sys.path (what pip --target
    writes: the package and a .dist-info with entry_points.txt): `meta_good` registers a
    transport, `meta_broken` raises when imported."""
    site = tmp_path / "site"
    for ep, package, plugin in (("meta_good", "ws_meta_good", GOOD_PLUGIN),
                                ("meta_broken", "ws_meta_broken",
                                 'raise ImportError("ws_meta_broken needs librdmacm")\n')):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        (site / package / "plugin.py").write_text(plugin)
        info = site / f"weightsync_{ep}-0.1.0.dist-info"
        info.mkdir()
        dist = "weightsync-" + ep.replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[weightsync]\n{ep} = {package}.plugin\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for mod in [m for m in sys.modules if m.startswith(("ws_meta_good", "ws_meta_broken"))]:
        del sys.modules[mod]


def entry_point_plugins(pm: pluggy.PluginManager) -> set[str]:
    return {name for name, _ in pm.list_name_plugin()} - {"weightsync.builtin"}


def test_broken_plugin_is_a_warning_and_the_rest_keep_working(
        site: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WEIGHTSYNC_PLUGINS", "meta_good,meta_broken")
    with caplog.at_level(logging.WARNING, logger="weightsync.plugins"):
        components = load_components(make_plugin_manager())
    assert "weightsync plugin 'meta_broken' failed to import" in caplog.text
    assert "librdmacm" in components.failed["meta_broken"]
    assert entry_point_plugins(components.pm) == {"meta_good"}
    assert components.transports.get("meta-good").__module__ == "ws_meta_good.plugin"
    assert "http" in components.transports
    rows = {r["name"]: r for r in describe_plugins(components)}
    assert rows["meta_good"]["distribution"] == "weightsync-meta-good"
    assert rows["meta_good"]["components"] == ["transport:meta-good"]
    assert "librdmacm" in rows["meta_broken"]["error"]


def test_unknown_kind_lists_installed_and_failed(site: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_PLUGINS", "meta_good,meta_broken")
    components = load_components(make_plugin_manager())
    with pytest.raises(PluginError) as err:
        components.transports.get("rdma")
    msg = str(err.value)
    installed = re.search(r"installed: (\[.*?\])", msg)
    assert installed is not None, msg
    assert {"http", "meta-good"} <= set(json.loads(installed.group(1).replace("'", '"')))
    assert "plugins that failed to import: meta_broken" in msg and "librdmacm" in msg
    with pytest.raises(PluginError, match="unknown transport 'rdma'.*meta_broken"):
        resolve(SyncConfig.load({"transport": "rdma", "engines": [{"url": "http://127.0.0.1:1"}]}),
                components)


def test_plugins_allowlist_and_autoload_switch(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    installed = {ep.name for ep in importlib.metadata.entry_points(group="weightsync")}
    assert {"meta_good", "meta_broken"} <= installed

    monkeypatch.setenv("WEIGHTSYNC_PLUGINS", "")
    components = load_components(make_plugin_manager())
    assert entry_point_plugins(components.pm) == set() and components.failed == {}
    assert {"http", "collective"} <= set(components.transports.names())
    assert "raw" in components.encodings and "torch" in components.exporters
    assert "reference" not in components.adapters          # the reference engine is a plugin too

    monkeypatch.setenv("WEIGHTSYNC_PLUGINS", "meta_good")
    assert entry_point_plugins(make_plugin_manager()) == {"meta_good"}

    monkeypatch.setenv("WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert entry_point_plugins(make_plugin_manager()) == set()

    monkeypatch.delenv("WEIGHTSYNC_PLUGINS")
    monkeypatch.delenv("WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD")
    loaded = entry_point_plugins(make_plugin_manager())
    assert {"meta_good", "meta_broken"} & loaded == {"meta_good"}


def test_weightsync_plugins_command_lists_the_failed_plugin(site: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])),
               WEIGHTSYNC_PLUGINS="meta_good,meta_broken", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "weightsync", "plugins", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["meta_good"]["components"] == ["transport:meta-good"]
    assert "librdmacm" in rows["meta_broken"]["error"] and rows["meta_broken"]["components"] == []
    assert "weightsync plugin 'meta_broken' failed to import" in r.stderr


def test_example_in_hooks_md_intro_is_a_plain_hookimpl() -> None:
    """The first block shows the package form: a module-level function with the spec's name."""
    code = textwrap.dedent(python_blocks()[0])
    assert "@hookimpl\ndef register_transports(register):" in code
