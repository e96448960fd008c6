"""PEFT (LoRA) policies: merged weights under the base model's names, or the adapter alone.

Merged: each weight a LoRA layer adapts is sent as `W + delta`, computed for that tensor only when
its bucket is built, with the operations PEFT's `merge_and_unload()` performs (so the bytes equal
a merged-then-saved model's), never a merged copy of the whole model. Adapter alone: what PEFT's
`save_pretrained` writes, for engines that serve adapters by name (vLLM's LoRA routes). peft is
imported only when the model carries PEFT layers."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, cast

import torch

from weightsync.exporters.plan import Source, is_dtensor

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_config", "adapter_name", "adapter_tensors",
           "base_model", "merged_sources", "peft_loaded", "write_adapter"]


def peft_loaded() -> bool:
    return sys.modules.get("peft") is not None


def base_model(model: Any) -> Any:
    """The model PEFT wraps (a PeftModel's base model, with its LoRA layers inside), or `model`."""
    wrapped = type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")
    return model.get_base_model() if peft_loaded() and wrapped else model


def _layers(model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tuner layers, modules_to_save wrappers) by module path."""
    if not peft_loaded():
        return {}, {}
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper
    tuners, wrappers = {}, {}
    for path, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            tuners[path] = m
        elif isinstance(m, ModulesToSaveWrapper):
            wrappers[path] = m
    return tuners, wrappers


def _unwrapped_name(name: str, tuners: dict[str, Any], wrappers: dict[str, Any]) -> str | None:
    """The name this tensor has after `merge_and_unload()`, or None when it is the adapter's own
    (LoRA factors, an inactive `modules_to_save` copy, the original a copy replaces)."""
    parts = name.split(".")
    kept: list[str] = []
    i = 0
    while i < len(parts):
        prefix = ".".join(parts[:i])
        if i and prefix in tuners:
            if parts[i] != "base_layer":
                return None
            i += 1
            continue
        if i and prefix in wrappers:
            w = wrappers[prefix]
            want = (["modules_to_save", w.active_adapter] if w.active_adapters
                    else ["original_module"])
            if parts[i:i + len(want)] != want:
                return None
            i += len(want)
            continue
        kept.append(parts[i])
        i += 1
    return ".".join(kept)


def _inner_path(path: str, layer: Any) -> str:
    """Module path of the layer a (possibly nested) tuner layer finally wraps."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    m, path = layer.base_layer, path + ".base_layer"
    while isinstance(m, BaseTunerLayer):      # peft's tuner layers set base_layer in __init__
        m, path = cast(Any, m).base_layer, path + ".base_layer"
    return path


def _merge_steps(tuners: dict[str, Any]) -> dict[str, list[tuple[Any, str, str]]]:
    """For every tensor a LoRA layer adapts, in PEFT's merge order: (layer, adapter, what)."""
    from peft.tuners.lora.layer import Embedding, LoraLayer, ParamWrapper
    steps: dict[str, list[tuple[Any, str, str]]] = {}
    for path, layer in tuners.items():
        if not isinstance(layer, LoraLayer):
            raise ValueError(f"{path} is a {type(layer).__name__}: merged export supports LoRA "
                             f"layers only; merge it with PEFT first or push a state dict")
        factors = layer.lora_embedding_A if isinstance(layer, Embedding) else layer.lora_A
        adapters = list(layer.active_adapters)
        if layer.merged:                      # already in the base weight: nothing to add
            adapters = [a for a in adapters if a not in set(layer.merged_adapters)]
        inner = _inner_path(path, layer)
        for a in adapters:
            if a not in factors:
                continue
            if a in getattr(layer, "lora_variant", {}):
                variant = type(layer.lora_variant[a]).__name__
                raise ValueError(f"{path}: adapter {a!r} is a LoRA variant ({variant}); merged "
                                 f"export supports plain LoRA only: merge it with PEFT first or "
                                 f"export the adapter")
            if isinstance(layer, ParamWrapper):
                steps.setdefault(f"{inner}.{layer.parameter_name}", []).append((layer, a, "delta"))
                continue
            kind = "delta_cast" if isinstance(layer, Embedding) else "delta"
            steps.setdefault(f"{inner}.weight", []).append((layer, a, kind))
            if layer.lora_bias.get(a, False):
                steps.setdefault(f"{inner}.bias", []).append((layer, a, "bias"))
    return steps


def _merger(steps: list[tuple[Any, str, str]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The merged value of one tensor, by the in-place additions PEFT's unsafe merge makes."""
    def merge(w: torch.Tensor) -> torch.Tensor:
        out = w.detach().clone(memory_format=torch.contiguous_format)
        with torch.no_grad():
            for layer, adapter, kind in steps:
                if kind == "delta":
                    out += layer.get_delta_weight(adapter)
                elif kind == "delta_cast":
                    out += layer.get_delta_weight(adapter).to(out.dtype)
                else:
                    out += layer.lora_B[adapter].bias * layer.scaling[adapter]
        return out
    return merge


def merged_sources(model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> list[Source]:
    """`items` (the base model's state dict) as sources under the merged model's names; the
    tensors LoRA adapts carry their merge. Without PEFT layers: the items as they are."""
    tuners, wrappers = _layers(model)
    if not tuners and not wrappers:
        return [Source(n, t) for n, t in items]
    steps = _merge_steps(tuners)
    out = []
    for name, t in items:
        merged_name = _unwrapped_name(name, tuners, wrappers)
        if merged_name is None:
            continue
        merge = _merger(steps[name]) if name in steps else None
        if merge is not None and is_dtensor(t):
            raise ValueError(f"{name}: merging LoRA into a sharded (DTensor) weight is not "
                             f"supported; push the adapter alone, or merge on the full model")
        out.append(Source(merged_name, t, merge))
    return out


# -- the adapter alone --------------------------------------------------------------------

def adapter_name(model: Any, adapter: str | None = None) -> str:
    name = adapter or getattr(model, "active_adapter", None)
    if not isinstance(name, str) or name not in getattr(model, "peft_config", {}):
        raise ValueError(f"adapter {name!r} is not one of the model's adapters "
                         f"{sorted(getattr(model, 'peft_config', {}))}")
    return name


def adapter_tensors(model: Any, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names PEFT's `save_pretrained` writes (sharded ones
    gathered: every rank must call this for a DTensor model)."""
    from peft.utils import get_peft_model_state_dict
    sd = get_peft_model_state_dict(model, adapter_name=adapter_name(model, adapter))
    detached = {k: t.detach() for k, t in sd.items()}
    return {k: t.full_tensor() if is_dtensor(t) else t for k, t in detached.items()}


def adapter_config(model: Any, adapter: str | None = None) -> dict[str, Any]:
    """adapter_config.json as PEFT's `save_pretrained` writes it."""
    name = adapter_name(model, adapter)
    cfg = copy.deepcopy(model.peft_config[name])
    if cfg.base_model_name_or_path is None:
        inner = getattr(getattr(model, "base_model", None), "model", None)
        cfg.base_model_name_or_path = (getattr(inner, "__dict__", {}).get("name_or_path") or None)
    cfg.inference_mode = True
    out = cfg.to_dict()
    if cfg.task_type is None and hasattr(model, "_get_base_model_class"):
        cls = model._get_base_model_class(is_prompt_tuning=cfg.is_prompt_learning)  # noqa: SLF001
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def write_adapter(directory: str | Path, tensors: dict[str, torch.Tensor],
                  config: dict[str, Any]) -> Path:
    """Write an adapter directory atomically (a temporary sibling renamed into place), so an
    engine never reads half an adapter. Returns the directory."""
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; every adapter version needs a new directory")
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory)
    return directory
