"""The engine side of a sync, for engines that run weightsync's own receiving code (the reference
engine, the vLLM backend, the disk agent). It stages every bucket, checks names, shapes, dtypes and
digests, and applies nothing until commit, so a failed sync leaves the engine at its old version."""

from __future__ import annotations

import difflib
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from .bucket import digest_algo, digest_tensors, dtype_name
from .config import ComponentRef, build_options
from .errors import PayloadError
from .interfaces import Encoding, Payload, TransportReceiver


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
    """Plain named tensors (a weights-only engine).

    With `owned` (the default) nothing outside holds these tensors, so the store stages into
    buffers it keeps from round to round (warm memory: no page faults per sync) and a commit
    adopts the staged tensors instead of copying them; the old live tensors become the next
    round's staging buffers. Each received byte is then copied exactly once on the engine side."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], owned: bool = True) -> None:
        self._tensors = dict(tensors)
        self._owned = owned
        self._staging: dict[str, torch.Tensor] = {}

    def staging_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """A buffer to stage `name` in (shaped like the live tensor), or None: clone."""
        if not self._owned or name not in self._tensors:
            return None
        live = self._tensors[name]
        buf = self._staging.get(name)
        if buf is None or buf.shape != live.shape or buf.dtype != live.dtype or buf.device != live.device:
            buf = self._staging[name] = torch.empty_like(live)
        return buf

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor]) -> None:
        for name, t in named.items():
            if self._owned and self._staging.get(name) is t:
                self._staging[name], self._tensors[name] = self._tensors[name], t
            else:
                self._tensors[name].detach().copy_(t)


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


def read_checkpoint(path: str | Path, check: Callable[[str, torch.Tensor], Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors checkpoint directory, each passed to `check` first, so
    a reload-from-disk reads and checks everything before anything is applied."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise PayloadError(f"checkpoint directory {path} does not exist on the engine's host")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PayloadError(f"checkpoint directory {path} holds no *.safetensors files")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as e:
            raise PayloadError(f"checkpoint file {f} cannot be read ({e}); nothing was loaded") from None
        for n, t in tensors.items():
            if n in named:
                raise PayloadError(f"tensor {n!r} appears in two files of {path}")
            check(n, t)
            named[n] = t
    return named


def round_digests(digests: Mapping[int, str], last_index: int | None) -> dict[int, str]:
    """The digests of a complete round, or an error naming what never arrived."""
    if last_index is None:
        raise PayloadError("the round ended before the last bucket arrived")
    missing = sorted(set(range(last_index + 1)) - set(digests))
    if missing:
        raise PayloadError(f"buckets {missing} never arrived")
    return dict(digests)


def build_encoding(ref: Mapping[str, Any], components: Any) -> Encoding:
    """The encoding a plan names, built in the engine's process from its own registry."""
    r = ComponentRef.model_validate(ref)
    cls = components.encodings.get(r.kind)
    return cls(build_options(cls, r, "encoding"))


def build_receiver(ref: Mapping[str, Any], components: Any) -> TransportReceiver:
    """The receiving half of the transport a plan names."""
    r = ComponentRef.model_validate(ref)
    cls = components.transports.get(r.kind)
    if cls.receiver is None:
        raise PayloadError(f"transport {r.kind!r} has no receiving half for this engine")
    return cls.receiver(build_options(cls, r, "transport"))


def decode_checked(encoding: Encoding, payload: Payload, current: Callable[[str], torch.Tensor | None],
                   check: Callable[[str, torch.Tensor], Any]) -> list[tuple[str, torch.Tensor]]:
    """Decode a payload into its tensors in header order, each checked by `check(name, t)`."""
    decoded = dict(encoding.decode(payload, current))
    order = [s.name for s in payload.specs]
    if set(decoded) != set(order):
        raise PayloadError(f"bucket {payload.index}: decoded tensors {sorted(decoded)} "
                           f"differ from the header's {sorted(order)}")
    named = [(n, decoded[n]) for n in order]
    for n, t in named:
        check(n, t)
    return named


def check_digest(payload: Payload, got: str) -> None:
    if got != payload.digest:
        first = payload.specs[0].name if payload.specs else "-"
        raise PayloadError(f"bucket {payload.index} (tensors {first!r}..): digest {got} does not "
                           f"match the sender's {payload.digest}; the payload was corrupted in "
                           f"transit and nothing was applied")


class ReceiveSession:
    """One update round inside an engine: begin -> apply* -> end -> commit | abort."""

    def __init__(self, store: WeightStore, plan: Mapping[str, Any], components: Any) -> None:
        self.store = store
        self.version = int(plan["version"])
        self.encoding = build_encoding(plan["encoding"], components)
        if plan.get("engine_version") is not None:
            self.encoding.receiving(int(plan["engine_version"]))
        self.rx: TransportReceiver = build_receiver(plan["transport"], components)
        self.staged: dict[str, torch.Tensor] = {}
        self.digests: dict[int, str] = {}
        self.last_index: int | None = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.busy = 0          # payloads being staged right now
        self.closed = False

    def _stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A private copy of `t`: into the store's reusable buffer when it offers one."""
        take = getattr(self.store, "staging_buffer", None)
        buf = take(name, t) if take is not None else None
        if buf is None:
            return t.clone()
        return buf.copy_(t)

    def join(self, info: Mapping[str, Any]) -> None:
        self.rx.join(info)

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str:
        """Receive, decode and stage one payload; returns the digest of what was staged."""
        buf = self.rx.receive(header, body)
        try:
            payload = Payload.from_header(header, buf)
            named = decode_checked(self.encoding, payload, self.store.get,
                                   lambda n, t: check_tensor(self.store, n, t))
            with self.lock:
                if self.closed:
                    raise PayloadError(f"bucket {payload.index} arrived after the update round closed")
                self.busy += 1
            try:      # stage (one copy), then digest what was staged: that is what commit loads
                staged = [(n, self._stage(n, t)) for n, t in named]
                got = digest_tensors(staged, digest_algo(payload.digest))
            finally:
                with self.lock:
                    self.busy -= 1
                    self.idle.notify_all()
            check_digest(payload, got)
            with self.lock:
                for n, t in staged:
                    self.staged[n] = t
                self.digests[payload.index] = got
                if payload.last:
                    self.last_index = payload.index
        finally:
            self.rx.release(header)
        return got

    def end(self) -> dict[int, str]:
        return round_digests(self.digests, self.last_index)

    def commit(self) -> None:
        self.end()
        self.store.load(self.staged)
        self.encoding.commit(self.version)
        self.close()

    def close(self) -> None:
        """No payload of this round writes into staging buffers after close returns (a new
        round reuses them)."""
        with self.lock:
            self.closed = True
            self.idle.wait_for(lambda: self.busy == 0, timeout=60)
            self.staged.clear()
        self.rx.close()
