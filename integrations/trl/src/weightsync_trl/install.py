"""`use_weightsync(config)`: swap TRL's sync client for weightsync's before a trainer is built,
and bind each trainer that uses it (version = its global step, metrics into its logs)."""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from .client import WeightSyncVLLMClient
from .session import ConfigSource, SyncSession, load_config

log = logging.getLogger("weightsync.trl")

# where TRL 1.16 builds its client (`VLLMClient(...)` by module-level name) ...
CLIENT_SEAMS = ("trl.generation.vllm_generation",)
# ... and the trainers that own a `vllm_generation` (the client's version and logs come from them)
TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))


@dataclass
class Installed:
    """What `use_weightsync` changed; `undo()` puts TRL back as it was."""

    client_cls: type[WeightSyncVLLMClient]
    sessions: list[SyncSession]
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)

    @property
    def last_report(self) -> Any:
        return self.sessions[-1].last_report if self.sessions else None

    def undo(self) -> None:
        for owner, name, old in reversed(self._restore):
            setattr(owner, name, old)
        self._restore.clear()
        for s in self.sessions:
            s.close()


def attach(trainer: Any) -> SyncSession | None:
    """Bind a built trainer to the weightsync client it holds (done for GRPOTrainer and
    RLOOTrainer by `use_weightsync`; call it for other trainers that own a `vllm_generation`),
    and add the final push (`FinalPush`) on every rank. Returns the session, or None when the
    trainer's client is not weightsync's (a non-main process holds none)."""
    generation = getattr(trainer, "vllm_generation", None)
    client = getattr(generation, "vllm_client", None)
    ours = isinstance(client, WeightSyncVLLMClient)
    main = getattr(getattr(trainer, "accelerator", None), "is_main_process", True)
    if generation is not None and getattr(generation, "mode", "server") == "server" and (ours or not main):
        add_final_push(trainer)
    if not isinstance(client, WeightSyncVLLMClient):
        return None
    client.weightsync.attach(trainer)
    return client.weightsync


class FinalPush(TrainerCallback):
    """TRL syncs at the start of a step, so after `train()` the servers would hold the weights
    from before the last optimizer step: at train end this runs TRL's own `sync_weights()` once
    more (every rank: FSDP/ZeRO gathers are collectives), as version `base + steps + 1`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if getattr(t, "_last_loaded_step", None) == state.global_step:
            return                      # the last optimizer step was synced already
        t.vllm_generation.sync_weights()
        t._last_loaded_step = state.global_step


def add_final_push(trainer: Any) -> None:
    handler = getattr(trainer, "callback_handler", None)
    if handler is None or any(isinstance(c, FinalPush) for c in handler.callbacks):
        return
    trainer.add_callback(FinalPush(trainer))


def use_weightsync(config: ConfigSource = None) -> Installed:
    """Make every TRL trainer built from now on in vLLM server mode sync through weightsync.

    `config` is a weightsync config (path, dict or SyncConfig); without `engines` or `fleet`
    the engine is TRL's own server (`vllm_server_base_url`). It is checked now, so a bad
    option fails here rather than at the first step."""
    load_config(config, server_url="http://127.0.0.1:8000")     # validate early
    sessions: list[SyncSession] = []
    cls = type("WeightSyncVLLMClient", (WeightSyncVLLMClient,),
               {"weightsync_config": config, "weightsync_sessions": sessions,
                "__module__": WeightSyncVLLMClient.__module__})
    done = Installed(cls, sessions)
    for modname in CLIENT_SEAMS:
        mod = importlib.import_module(modname)
        if not hasattr(mod, "VLLMClient"):
            raise RuntimeError(f"{modname} has no VLLMClient: this TRL is not a version "
                               f"weightsync-trl supports (TRL >=1.16,<1.17)")
        done._restore.append((mod, "VLLMClient", mod.VLLMClient))
        setattr(mod, "VLLMClient", cls)
    for modname, clsname in TRAINERS:
        try:
            trainer_cls = getattr(importlib.import_module(modname), clsname)
        except (ImportError, AttributeError):
            continue
        init = trainer_cls.__dict__.get("__init__")
        if init is None:                 # inherits its __init__: bound through its base
            continue
        done._restore.append((trainer_cls, "__init__", init))
        trainer_cls.__init__ = _binding(init)
    log.info("weightsync: TRL's vLLM server-mode sync now pushes through weightsync")
    return done


def _binding(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        attach(self)
    return __init__
