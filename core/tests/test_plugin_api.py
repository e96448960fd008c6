"""The declared plugin API (docs/writing-plugins.md, "The declared plugin API"): every module it
lists exists and says what it offers in `__all__`, and no plugin or integration imports anything
of core outside it (read statically from the sources, lazy imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/writing-plugins.md"
CORE = ROOT / "core/src"


def declared() -> list[str]:
    section = DOC.read_text().split("## The declared plugin API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(weightsync[\w.]*)` \|", section, re.M)


def _file(module: str) -> Path:
    p = CORE / module.replace(".", "/")
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def exported(module: str) -> set[str]:
    """The names in a module's `__all__` (a literal list or tuple of strings)."""
    tree = ast.parse(_file(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError(f"{module} ({_file(module).relative_to(ROOT)}) has no __all__")


def outside(api: list[str], sources: list[Path]) -> list[str]:
    """Each import of core by these files that the declared API does not cover."""
    allowed = {m: exported(m) for m in api}
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "weightsync" and alias.name not in allowed:
                        found.append(f"{where}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "weightsync":
                if node.module not in allowed:
                    # `from package import module` of a listed module is that module's import
                    if not all(f"{node.module}.{a.name}" in allowed for a in node.names):
                        found.append(f"{where}: from {node.module} import ...")
                    continue
                for alias in node.names:
                    if alias.name not in allowed[node.module] and \
                            f"{node.module}.{alias.name}" not in allowed:
                        found.append(f"{where}: {alias.name} from {node.module}")
    return found


def plugin_sources() -> list[Path]:
    return sorted([*ROOT.glob("plugins/*/src/**/*.py"), *ROOT.glob("integrations/*/src/**/*.py")])


def test_the_table_is_read_and_every_module_has_all() -> None:
    api = declared()
    assert {"weightsync", "weightsync.interfaces", "weightsync.wire.bucket"} <= set(api)
    for module in api:
        assert not any(part.startswith("_") for part in module.split(".")), module
        assert exported(module), f"{module} exports nothing"
        names = {n.name for n in ast.parse(_file(module).read_text()).body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        names |= {t.id for n in ast.parse(_file(module).read_text()).body
                  if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Name)}
        for name in exported(module):
            if module == "weightsync":
                continue   # the package's names load on first use (`__getattr__`)
            assert name in names or _imports(module, name), f"{module}.__all__ names {name!r}, " \
                "which the module neither defines nor imports"


def _imports(module: str, name: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and name in {a.asname or a.name for a in n.names}
               for n in ast.walk(ast.parse(_file(module).read_text())))


def test_plugins_and_integrations_import_only_the_declared_api() -> None:
    found = outside(declared(), plugin_sources())
    assert not found, "imports outside the declared plugin API (docs/writing-plugins.md):\n" + \
        "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    """The check is not vacuous: a private module, an unlisted module and an unexported name
    are each reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("import weightsync.wire.jit\nfrom weightsync.sync.rounds import GroupRound\n"
                     "from weightsync.wire.bucket import _private\nimport weightsync._gone\n"
                     "from weightsync.wire.bucket import Bucket\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = outside(declared(), [probe])
    finally:
        ROOT = saved
    assert [f.split(": ", 1)[1] for f in found] == [
        "from weightsync.sync.rounds import ...", "_private from weightsync.wire.bucket",
        "import weightsync._gone"]
