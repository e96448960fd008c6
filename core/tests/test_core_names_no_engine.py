"""Core knows no engine and no plugin: no import of a plugin package and no engine or plugin name
in a string constant anywhere in core's source (docstrings and comments may mention them). What
differs per engine lives on its adapter, which core looks up by kind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import weightsync

SRC = Path(weightsync.__file__).parent
NAMES = re.compile(r"vllm|sglang|lmdeploy|disk[_-]?delta|tensorrt|trtllm", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    """Strings that stand alone as statements: docstrings of modules, classes, functions and
    attributes."""
    return {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def test_core_imports_no_plugin_and_names_no_engine() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        rel = path.relative_to(SRC)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith("weightsync_")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("weightsync_"):
                found.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docs and NAMES.search(node.value)):
                found.append(f"{rel}:{node.lineno}: {node.value[:80]!r}")
    assert not found, "core names engines or plugins:\n" + "\n".join(found)
