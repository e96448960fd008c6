"""The engine side of a sync, for engines that run weightsync's own receiving code (the reference
engine, the vLLM backend, the disk agent). It stages every bucket, checks names, shapes, dtypes and
digests, and applies nothing until commit, so a failed sync leaves the engine at its old version."""

from __future__ import annotations

import difflib
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from .bucket import combine_digests, digest_algo, digest_tensors, dtype_name, tensor_header
from .config import ComponentRef, build_options
from .errors import PayloadError
from .hashing import copy_digest_many
from .interfaces import Encoding, Payload, TransportReceiver
from .signing import check as check_signature


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
        hint = f"; did you mean {close}?" if close else ""
        hint += ("; the exporter sends checkpoint names (option checkpoint_layout), can check "
                 "them against the engine's checkpoint before sending (expect_names_from), and "
                 "maps names with rename / skip / name_map")
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
    order = [s.name for s in payload.specs]
    if len(set(order)) != len(order):
        dup = next(n for n in order if order.count(n) > 1)
        raise PayloadError(f"bucket {payload.index} names tensor {dup!r} twice; a tensor is sent "
                           f"once per round")
    decoded = dict(encoding.decode(payload, current))
    if set(decoded) != set(order):
        raise PayloadError(f"bucket {payload.index}: decoded tensors {sorted(decoded)} "
                           f"differ from the header's {sorted(order)}")
    named = [(n, decoded[n]) for n in order]
    for n, t in named:
        check(n, t)
    return named


def stage_digest(named: list[tuple[str, torch.Tensor]],
                 buffer: Callable[[str, torch.Tensor], torch.Tensor], algo: str,
                 private: bool = False) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """Copy each tensor into `buffer(name, t)` and digest what was written (the bucket digest
    of the copies, with `algo`). xxh3 on CPU: one pass, each chunk hashed right after it was
    copied (`weightsync.hashing.copy_digest`), the tensors spread over the cores; otherwise copy,
    then digest the copies. `private`: the tensors live in memory only this process writes (a
    receive buffer of its own), so each chunk may be hashed as it is read and streamed to the
    staging buffer (fewer memory transfers); shared memory a sender could still write is hashed
    from the copy."""
    bufs = [(n, buffer(n, t)) for n, t in named]
    if algo == "xxh3" and all(t.device.type == "cpu" for _, t in named):
        digests = copy_digest_many([(b, t, tensor_header(n, t)) for (n, t), (_, b) in zip(named, bufs)],
                                   source=private)
        return bufs, combine_digests(digests)
    for (_, t), (_, b) in zip(named, bufs):
        b.copy_(t)
    return bufs, digest_tensors(bufs, algo)


def payload_nbytes(header: Mapping[str, Any]) -> int:
    try:
        return int(header["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise PayloadError("payload header lacks a valid 'nbytes'") from None


def read_exact(read_into: Callable[[memoryview], int], view: memoryview) -> None:
    """Fill `view` from `read_into`; PayloadError when the stream ends first."""
    got, n = 0, len(view)
    while got < n:
        k = read_into(view[got:])
        if not k:
            raise PayloadError(f"request body ended after {got} of {n} bytes")
        got += k


class BodyReader:
    """A payload body arriving through `read_into`, read at most `nbytes`, in pieces small
    enough to be hashed while they are still in cache."""

    PIECE = 256 << 10

    def __init__(self, read_into: Callable[[memoryview], int], nbytes: int) -> None:
        self.read_into, self.left = read_into, nbytes
        self.total = nbytes

    def exact(self, view: memoryview, feed: Callable[[int, int], Any] | None = None) -> None:
        """Fill `view`; `feed(offset, count)` after each piece lands in it."""
        n = len(view)
        if n > self.left:
            raise PayloadError(f"the payload body is {self.total} bytes; its header describes more")
        got = 0
        while got < n:
            k = self.read_into(view[got: got + min(self.PIECE, n - got)])
            if not k:
                self.left = 0
                raise PayloadError(f"request body ended {self.total - self.left + got} bytes in, "
                                   f"of {self.total}")
            if feed is not None:
                feed(got, k)
            got += k
        self.left -= n

    def drain(self) -> None:
        """Read and drop the rest (a refused payload), so the connection stays in step."""
        scratch = memoryview(bytearray(min(self.PIECE, max(self.left, 1))))
        while self.left > 0:
            k = self.read_into(scratch[: min(len(scratch), self.left)])
            if not k:
                self.left = 0
                return
            self.left -= k


def read_staged(payload: Payload, reader: BodyReader,
                buffer_for: Callable[[str, torch.dtype, list[int]], torch.Tensor],
                check: Callable[[str, torch.Tensor], Any]) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Read a payload body in safetensors layout from `reader` straight into one buffer per
    tensor (`buffer_for(name, dtype, shape)`, CPU, contiguous), hashing each piece right after it
    lands: the staged tensors and their xxh3-128 digests, both in the payload header's order.
    The safetensors header is checked against the payload header (names, dtypes, shapes) and
    `check(name, meta tensor)` (the engine's names and shapes) before any tensor byte is read,
    and its offsets must tile the data section; a refused body is drained."""
    from .wire import header_length, parse_header
    specs = {s.name: s for s in payload.specs}
    try:
        prefix = memoryview(bytearray(8))
        reader.exact(prefix)
        hlen = header_length(prefix, reader.total)
        raw = memoryview(bytearray(hlen))
        reader.exact(raw)
        entries, _ = parse_header(raw, reader.total)
        if sorted(e[0] for e in entries) != sorted(specs):
            raise PayloadError(f"bucket {payload.index}: the body carries tensors "
                               f"{sorted(e[0] for e in entries)[:5]}.., the header "
                               f"{sorted(specs)[:5]}..")
        entries.sort(key=lambda e: (e[3], e[4]))
        at = 0
        for name, dtype, shape, a, b in entries:
            spec = specs[name]
            if dtype_name(dtype) != spec.dtype or tuple(shape) != tuple(spec.shape):
                raise PayloadError(f"tensor {name!r}: the body says {dtype_name(dtype)} {shape}, "
                                   f"the header {spec.dtype} {list(spec.shape)}")
            if a != at:
                raise PayloadError(f"tensor {name!r}: data at {a}, expected {at} (the tensors "
                                   f"must tile the body)")
            at = b
            check(name, torch.empty(shape, dtype=dtype, device="meta"))
        if at != reader.left:
            raise PayloadError(f"bucket {payload.index}: tensors end at {at} of a {reader.left}-byte "
                               f"data section")
    except BaseException:
        reader.drain()
        raise
    from .hashing import Digest
    out: dict[str, tuple[torch.Tensor, str]] = {}
    try:
        for name, dtype, shape, a, b in entries:
            buf = buffer_for(name, dtype, shape)
            d = Digest(tensor_header(name, buf))
            if b > a:
                base = buf.data_ptr()
                view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
                reader.exact(view, lambda off, k: d.update_at(base + off, k))
            out[name] = (buf, d.hexdigest())
    except BaseException:
        reader.drain()
        raise
    order = [s.name for s in payload.specs]
    return [(n, out[n][0]) for n in order], [out[n][1] for n in order]


def stage_from(rx: TransportReceiver, header: Mapping[str, Any], named: list[tuple[str, torch.Tensor]],
               buffer: Callable[[str, torch.Tensor], torch.Tensor], algo: str
               ) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """`stage_digest` of a body that transport receiver `rx` lent for `header`: hashed as it is
    read where the body is the receiver's own memory (`rx.private`) or the receiver vouches for
    it (`rx.hash_source(header)`, then `rx.unchanged(header)` after the copy), else hashed from
    the copies."""
    vouch = getattr(rx, "hash_source", None)
    private = bool(vouch(header)) if vouch is not None else bool(getattr(rx, "private", False))
    out = stage_digest(named, buffer, algo, private)
    unchanged = getattr(rx, "unchanged", None)
    if unchanged is not None:
        unchanged(header)
    return out


def check_digest(payload: Payload, got: str) -> None:
    if got != payload.digest:
        first = payload.specs[0].name if payload.specs else "-"
        raise PayloadError(f"bucket {payload.index} (tensors {first!r}..): digest {got} does not "
                           f"match the sender's {payload.digest}; the payload was corrupted in "
                           f"transit and nothing was applied")


class ReceiveSession:
    """One update round inside an engine: begin -> apply* -> end -> commit | abort."""

    def __init__(self, store: WeightStore, plan: Mapping[str, Any], components: Any,
                 key: bytes | None = None) -> None:
        self.store = store
        self.key = key                 # HMAC key: payloads must be signed (weightsync.signing)
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
        self.owner: dict[str, int] = {}   # tensor name -> the bucket that carries it this round
        self.busy_index: set[int] = set()
        self.closed = False

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Where `t` is staged: the store's reusable buffer when it offers one, else new memory."""
        take = getattr(self.store, "staging_buffer", None)
        buf = take(name, t) if take is not None else None
        return torch.empty_like(t, memory_format=torch.contiguous_format) if buf is None else buf

    def _stage_all(self, named: list[tuple[str, torch.Tensor]], algo: str,
                   header: Mapping[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """A private copy of every tensor, and the digest of those copies (what commit loads)."""
        return stage_from(self.rx, header, named, self._buffer, algo)

    def join(self, info: Mapping[str, Any]) -> None:
        self.rx.join(info)

    def _claim(self, payload: Payload, names: list[str]) -> bool:
        """Take the names of `payload` for this round; False: it was already staged (a retry)."""
        with self.lock:
            if self.closed:
                raise PayloadError(f"bucket {payload.index} arrived after the update round closed")
            if self.digests.get(payload.index) == payload.digest:
                return False                         # a retried bucket that was already staged
            again = [n for n in names if self.owner.get(n, payload.index) != payload.index
                     or payload.index in self.busy_index]
            if again:
                raise PayloadError(f"tensor {again[0]!r} was already sent in this round; a tensor "
                                   f"is sent once per round (bucket {payload.index} refused)")
            self.owner.update((n, payload.index) for n in names)
            self.busy_index.add(payload.index)
            self.busy += 1
        return True

    def _unclaim(self, payload: Payload, names: list[str], ok: bool) -> None:
        with self.lock:
            self.busy -= 1
            self.busy_index.discard(payload.index)
            if not ok:                               # a resend of this bucket may try again
                for n in names:
                    self.owner.pop(n, None)
            self.idle.notify_all()

    def _keep(self, payload: Payload, staged: list[tuple[str, torch.Tensor]], got: str) -> None:
        with self.lock:
            for n, t in staged:
                self.staged[n] = t
            self.digests[payload.index] = got
            if payload.last:
                self.last_index = payload.index

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str:
        """Receive, decode and stage one payload; returns the digest of what was staged."""
        check_signature(self.key, self.version, header)
        buf = self.rx.receive(header, body)
        try:
            payload = Payload.from_header(header, buf)
            named = decode_checked(self.encoding, payload, self.store.get,
                                   lambda n, t: check_tensor(self.store, n, t))
            names = [n for n, _ in named]
            if not self._claim(payload, names):
                return payload.digest
            ok = False
            try:      # stage (one copy) and digest what was staged: that is what commit loads
                staged, got = self._stage_all(named, digest_algo(payload.digest), header)
                check_digest(payload, got)
                ok = True
            finally:
                self._unclaim(payload, names, ok)
            self._keep(payload, staged, got)
        finally:
            self.rx.release(header)
        return got

    def streams(self, header: Mapping[str, Any]) -> bool:
        """Whether `apply_stream` can read this payload's body straight into staging: a body
        carried in the request (http), an encoding whose wire form is the target tensors in
        safetensors layout (raw, cast), xxh3 digests, and CPU tensors in the store."""
        if not (getattr(self.rx, "in_band", False) and getattr(self.encoding, "streams", False)):
            return False
        if digest_algo(str(header.get("digest", ""))) != "xxh3":
            return False
        for t in header.get("tensors") or []:
            live = self.store.get(str(t.get("name"))) if isinstance(t, Mapping) else None
            if live is not None and live.device.type != "cpu":
                return False
        return True

    def apply_stream(self, header: Mapping[str, Any], read_into: Callable[[memoryview], int],
                     nbytes: int) -> str:
        """`apply` for a body that is still arriving (the http route): `read_into(view)` fills
        the start of `view` from the request and returns how many bytes it read (a socket's
        `recv_into`, a buffered reader's `readinto`). Where `streams(header)`, every tensor is
        read straight into its staging buffer and hashed piece by piece as it lands (no body
        buffer, no staging copy); otherwise the body is read whole and `apply` runs. Exactly
        `nbytes` are consumed either way, unless the request ends early (PayloadError), so the
        connection can serve the next request after a refusal."""
        if not self.streams(header):
            body = bytearray(nbytes)
            read_exact(read_into, memoryview(body))
            return self.apply(header, memoryview(body))
        reader = BodyReader(read_into, nbytes)
        try:
            check_signature(self.key, self.version, header)
            payload = Payload.from_header(header, torch.empty(0, dtype=torch.uint8))
            if nbytes != payload_nbytes(header):
                raise PayloadError(f"bucket {payload.index}: {nbytes} body bytes announced, "
                                   f"{header.get('nbytes')} were sent; the request was truncated")
            names = [spec.name for spec in payload.specs]
            if len(set(names)) != len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise PayloadError(f"bucket {payload.index} names tensor {dup!r} twice; a tensor "
                                   f"is sent once per round")
            if not self._claim(payload, names):
                reader.drain()
                return payload.digest
        except BaseException:
            reader.drain()
            raise
        ok = False
        try:
            staged, digests = read_staged(payload, reader, self._buffer_for,
                                          lambda n, t: check_tensor(self.store, n, t))
            got = combine_digests(digests)
            check_digest(payload, got)
            ok = True
        finally:
            self._unclaim(payload, names, ok)
        self._keep(payload, staged, got)
        return got

    def _buffer_for(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        take = getattr(self.store, "staging_buffer", None)
        like = torch.empty(shape, dtype=dtype, device="meta")
        buf = take(name, like) if take is not None else None
        if buf is None or buf.device.type != "cpu" or not buf.is_contiguous():
            buf = torch.empty(shape, dtype=dtype)
        return buf

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
