"""The reference engine's state machine: generation, pause gates, and one update round at a time.
Weights change only at commit, between two decoding steps, under the model lock."""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch

from ..bucket import dtype_name
from ..errors import PayloadError
from ..receiver import ReceiveSession, check_tensor, read_checkpoint
from .model import LoadedModel


class Conflict(PayloadError):
    """The request does not fit the engine's current state (HTTP 409)."""


class ReferenceEngine:
    def __init__(self, model: LoadedModel, components: Any, name: str = "reference") -> None:
        self.model = model
        self.components = components
        self.name = name
        self.version = 0
        self.model_lock = threading.Lock()       # held per decoding step and by commit
        self.state = threading.Condition()
        self.paused: str | None = None           # None, "abort" or "keep"
        self.pause_epoch = 0
        self.session: ReceiveSession | None = None
        self.session_lock = threading.Lock()

    # -- generation -------------------------------------------------------------------------
    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        if self.model.module is None:
            raise Conflict("this is a weights-only engine (no config.json); it cannot generate")
        if not ids:
            raise PayloadError("input_ids must not be empty")
        with self.state:
            while self.paused is not None:     # new requests wait for resume
                self.state.wait()
            epoch = self.pause_epoch
        out: list[int] = []
        for _ in range(max_new_tokens):
            with self.state:
                while self.paused == "keep":
                    self.state.wait()
                if self.paused == "abort" or self.pause_epoch != epoch and self.paused is not None:
                    return {"output_ids": out, "finish_reason": "abort", "version": self.version}
            with self.model_lock:
                tok = self.model.next_token(ids + out)
                version = self.version
            out.append(tok)
        return {"output_ids": out, "finish_reason": "length", "version": version}

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "keep"):
            raise PayloadError(f"pause mode {mode!r} is not supported; use 'abort' or 'keep'")
        with self.state:
            self.paused = mode
            self.pause_epoch += 1
            self.state.notify_all()

    def resume(self) -> None:
        with self.state:
            self.paused = None
            self.state.notify_all()

    # -- update round -----------------------------------------------------------------------
    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        if version <= self.version:
            raise Conflict(f"version {version} is not newer than the engine's version {self.version}")
        with self.session_lock:
            if self.session is not None:
                self.session.close()           # a previous round died half way: drop it
            self.session = ReceiveSession(self.model.store, {**plan, "version": version,
                                                             "engine_version": self.version},
                                          self.components)

    def _current(self) -> ReceiveSession:
        s = self.session
        if s is None:
            raise Conflict("no update round is open; call /weightsync/begin first")
        return s

    def join(self, info: Mapping[str, Any]) -> None:
        self._current().join(info)

    def apply(self, header: Mapping[str, Any], body: memoryview | None) -> str:
        return self._current().apply(header, body)

    def end(self) -> dict[int, str]:
        return self._current().end()

    def commit(self, version: int) -> None:
        with self.session_lock:
            s = self._current()
            if s.version != version:
                raise Conflict(f"commit of version {version}, but the open round is for {s.version}")
            with self.model_lock:
                s.commit()
                self.version = version
            self.session = None

    def abort(self) -> None:
        with self.session_lock:
            if self.session is not None:
                self.session.close()
                self.session = None

    def load_from_disk(self, path: str, version: int) -> int:
        """Reload weights from every *.safetensors in `path` (a host-local checkpoint the disk
        agent keeps) and set `version`. Everything is read and checked first, then applied under
        the model lock in one step, so any error leaves the engine untouched at its version."""
        if int(version) < 0:
            raise PayloadError(f"version {version} is negative")
        named = read_checkpoint(path, lambda n, t: check_tensor(self.model.store, n, t))
        with self.session_lock:
            if self.session is not None:
                raise Conflict("an update round is open; finish or abort it before reloading from disk")
            with self.model_lock:
                self.model.store.load(named)
                self.version = int(version)
        return self.version

    # -- introspection ----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        store = self.model.store
        return {"name": self.name, "version": self.version, "model": self.model.kind,
                "paused": self.paused, "can_generate": self.model.module is not None,
                "tensors": {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                            for n in store.names() if (t := store.get(n)) is not None}}

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        with self.model_lock:
            for n in names or self.model.store.names():
                t = self.model.store.get(n)
                if t is None:
                    raise PayloadError(f"tensor {n!r} is not in the engine's model")
                out[n] = t.detach().to("cpu", copy=True).contiguous()
        return out
