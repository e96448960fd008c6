"""The engine side of a sync, for engines that run weightsync's own receiving code (the reference
engine, the vLLM backend, the disk agent). It stages every bucket, checks names, shapes, dtypes and
digests, and applies nothing until commit, so a failed sync leaves the engine at its old version."""

from __future__ import annotations

import difflib
import threading
from typing import Any, Mapping, Protocol

import torch

from .bucket import digest_tensors, dtype_name
from .config import ComponentRef, build_options
from .errors import PayloadError
from .interfaces import Payload, TransportReceiver


class WeightStore(Protocol):
    """What an engine exposes to the receiver: its tensors by HF name, and an atomic load."""

    def get(self, name: str) -> torch.Tensor | None: ...

    def names(self) -> list[str]: ...

    def load(self, named: Mapping[str, torch.Tensor]) -> None: ...


class ModuleStore:
    """A torch module's state dict (tied aliases included) as a WeightStore."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._tensors = dict(module.state_dict(keep_vars=True))

    def get(self, name: str) -> torch.Tensor | None:
        t = self._tensors.get(name)
        return None if t is None else t.detach()

    def names(self) -> list[str]:
        return list(self._tensors)

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor]) -> None:
        for name, t in named.items():
            self._tensors[name].detach().copy_(t)


class DictStore(ModuleStore):
    """Plain named tensors (a weights-only engine)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)


def check_tensor(store: WeightStore, name: str, t: torch.Tensor) -> torch.Tensor:
    """The engine's tensor for `name`, or an error saying exactly what does not match."""
    live = store.get(name)
    if live is None:
        close = difflib.get_close_matches(name, store.names(), n=3)
        hint = f"; did you mean {close}?" if close else "; fix the exporter's name map"
        raise PayloadError(f"tensor {name!r} is not in the engine's model{hint}")
    if tuple(live.shape) != tuple(t.shape):
        raise PayloadError(f"tensor {name!r}: shape {list(t.shape)} sent, engine has {list(live.shape)}")
    if live.dtype != t.dtype:
        raise PayloadError(f"tensor {name!r}: dtype {dtype_name(t.dtype)} sent, engine has "
                           f"{dtype_name(live.dtype)}; use encoding 'cast' with dtype "
                           f"{dtype_name(live.dtype)!r}")
    return live


class ReceiveSession:
    """One update round inside an engine: begin -> apply* -> end -> commit | abort."""

    def __init__(self, store: WeightStore, plan: Mapping[str, Any], components: Any) -> None:
        self.store = store
        self.version = int(plan["version"])
        enc_ref = ComponentRef.model_validate(plan["encoding"])
        tr_ref = ComponentRef.model_validate(plan["transport"])
        enc_cls = components.encodings.get(enc_ref.kind)
        self.encoding = enc_cls(build_options(enc_cls, enc_ref, "encoding"))
        if plan.get("engine_version") is not None:
            self.encoding.receiving(int(plan["engine_version"]))
        tr_cls = components.transports.get(tr_ref.kind)
        if tr_cls.receiver is None:
            raise PayloadError(f"transport {tr_ref.kind!r} has no receiving half for this engine")
        self.rx: TransportReceiver = tr_cls.receiver(build_options(tr_cls, tr_ref, "transport"))
        self.staged: dict[str, torch.Tensor] = {}
        self.digests: dict[int, str] = {}
        self.last_index: int | None = None
        self.lock = threading.Lock()

    def join(self, info: Mapping[str, Any]) -> None:
        self.rx.join(info)

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str:
        """Receive, decode and stage one payload; returns the digest of what was staged."""
        buf = self.rx.receive(header, body)
        try:
            payload = Payload.from_header(header, buf)
            decoded = dict(self.encoding.decode(payload, self.store.get))
            order = [s.name for s in payload.specs]
            if set(decoded) != set(order):
                raise PayloadError(f"bucket {payload.index}: decoded tensors {sorted(decoded)} "
                                   f"differ from the header's {sorted(order)}")
            named = [(n, decoded[n]) for n in order]
            for n, t in named:
                check_tensor(self.store, n, t)
            got = digest_tensors(named)
            if got != payload.digest:
                raise PayloadError(f"bucket {payload.index} (tensors {order[0]!r}..): digest "
                                   f"{got} does not match the sender's {payload.digest}; the payload "
                                   f"was corrupted in transit and nothing was applied")
            with self.lock:
                for n, t in named:
                    self.staged[n] = t.clone()
                self.digests[payload.index] = got
                if payload.last:
                    self.last_index = payload.index
        finally:
            self.rx.release(header)
        return got

    def end(self) -> dict[int, str]:
        if self.last_index is None:
            raise PayloadError("the round ended before the last bucket arrived")
        missing = sorted(set(range(self.last_index + 1)) - set(self.digests))
        if missing:
            raise PayloadError(f"buckets {missing} never arrived")
        return dict(self.digests)

    def commit(self) -> None:
        self.end()
        self.store.load(self.staged)
        self.encoding.commit(self.version)
        self.close()

    def close(self) -> None:
        self.staged.clear()
        self.rx.close()
