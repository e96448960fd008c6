"""LMDeploy's own modules, imported without CUDA where they can be.

`lmdeploy/__init__.py`, `lmdeploy/serve/__init__.py` and `lmdeploy/serve/openai/__init__.py`
import the engines (and through them mmengine and CUDA kernels), so their package shells are
registered bare and only the leaf modules run: `lmdeploy.utils` (serialize_state_dict,
FlattenedTensorMetadata, FlattenedTensorBucket, init_custom_process_group) and
`lmdeploy.serve.openai.protocol` (UpdateParamsRequest and the group requests). `make test`
installs `lmdeploy==0.18.0` with --no-deps (and `shortuuid`, which protocol.py imports); an
engine is never a dependency of the plugin.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

LMDEPLOY_VERSION = "0.18.0"
_SHELLS = ("lmdeploy", "lmdeploy.serve", "lmdeploy.serve.openai")


def load(name: str) -> tuple[Any | None, str]:
    """(module, "") or (None, why it could not be imported)."""
    spec = importlib.util.find_spec("lmdeploy") if "lmdeploy" not in sys.modules else None
    if "lmdeploy" not in sys.modules:
        if spec is None or not spec.submodule_search_locations:
            return None, (f"lmdeploy is not installed (make test installs lmdeploy=={LMDEPLOY_VERSION} "
                          f"with --no-deps)")
        root = list(spec.submodule_search_locations)[0]
        for pkg in _SHELLS:
            if pkg not in sys.modules:
                m = types.ModuleType(pkg)
                m.__path__ = [os.path.join(root, *pkg.split(".")[1:])]
                sys.modules[pkg] = m
    try:
        return importlib.import_module(name), ""
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return None, f"{name} does not import here: {type(e).__name__}: {e}"


def version() -> str | None:
    mod, _ = load("lmdeploy.version")
    return getattr(mod, "__version__", None)
