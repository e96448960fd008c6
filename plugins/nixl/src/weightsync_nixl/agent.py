"""One NIXL agent per process and role: memory registration, the remote agents it knows, one-sided
READs bounded by a deadline, and notifications. Everything weightsync sends about NIXL is JSON:
agent metadata as base64, descriptors as integer triples (NIXL's own descriptor serialization is
pickle, which weightsync never loads from another process)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from weightsync.errors import ConfigError, PayloadError, TransportError
from weightsync_nixl import loader

log = logging.getLogger("weightsync_nixl")
NAME_RE = re.compile(r"^ws-[a-z]{1,16}-[0-9]{1,10}-[0-9a-f]{8}$")
MAX_REMOTES = 64
POLL_MIN, POLL_MAX = 0.0005, 0.001      # seconds between polls of a transfer (never busy-poll)
PUMP = 0.001                             # seconds between progress calls while a transfer may run

Desc = tuple[int, int, int]              # (address, length, device id)


@dataclass(eq=False)          # compared by identity: equality of tensors is elementwise
class Region:
    """Memory registered with the agent: `tensor` stays alive while registered."""

    tensor: torch.Tensor
    handle: Any
    mem: str

    def descs(self, offset: int = 0, nbytes: int | None = None) -> list[Desc]:
        n = self.tensor.numel() - offset if nbytes is None else nbytes
        return [(self.tensor.data_ptr() + offset, n, device_id(self.tensor))]


def device_id(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.is_cuda else 0


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


class Agent:
    """A NIXL agent named ws-<role>-<pid>-<token> (a restarted process is another agent)."""

    def __init__(self, role: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        api = loader.load()
        self.name = f"ws-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        # not NIXL's progress thread, which spins a core per agent for the process's life even
        # when idle (UCX over TCP): `busy`/`hold` progress the worker only while a transfer runs
        self.nixl = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False,
                                                                    backends=list(backends)))
        self.lock = threading.RLock()
        self.remotes: OrderedDict[str, str] = OrderedDict()     # name -> metadata fingerprint
        self.notes: dict[str, set[bytes]] = {}                   # agent -> notifications unread
        self.notes_lock = threading.Lock()
        self._md: bytes | None = None
        self._holds: dict[object, float] = {}     # why this agent progresses -> until when
        self._held = threading.Lock()
        self._pumping = False
        self._keys = itertools.count()
        self._threads: list[threading.Thread] = []    # ours that call NIXL: joined at exit
        self._adopted = threading.Lock()
        self.closing = threading.Event()

    # -- progress ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Progress this agent's worker while the block runs: over UCX/TCP a peer's READ of
        memory here completes only while this side progresses too."""
        key = next(self._keys)
        self.hold(key, 3600.0)
        try:
            yield
        finally:
            self.release(key)

    def hold(self, key: object, seconds: float) -> None:
        """Progress for `key` for at most `seconds` (until `release(key)`)."""
        with self._held:
            self._holds[key] = time.monotonic() + seconds
            if not self._pumping and not self.closing.is_set():
                self._pumping = True
                self.adopt(threading.Thread(target=self._pump_while_held, daemon=True,
                                            name="ws-nixl-progress")).start()

    def release(self, key: object) -> None:
        with self._held:
            self._holds.pop(key, None)

    def adopt(self, thread: threading.Thread) -> threading.Thread:
        """A thread of ours that calls NIXL: at exit it is waited for (it must end when
        `closing` is set), so none is inside NIXL while the interpreter tears NIXL down."""
        with self._adopted:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        return thread

    def quiesce(self, timeout: float = 5.0) -> None:
        """Stop progressing: end every hold and wait for our threads to leave NIXL."""
        self.closing.set()
        with self._held:
            self._holds.clear()
        with self._adopted:
            threads = list(self._threads)
        end = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    def _pump_while_held(self) -> None:
        """NIXL's own progress thread spins a core for the life of the process even when idle;
        this one runs only while something holds the agent, and ends when nothing does."""
        while True:
            with self._held:
                now = time.monotonic()
                for k in [k for k, until in self._holds.items() if until <= now]:
                    del self._holds[k]
                if not self._holds or self.closing.is_set():
                    self._pumping = False
                    return
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - a peer gone mid-transfer; its READ says so
                log.debug("nixl: progress call failed", exc_info=True)
            time.sleep(PUMP)

    def pump(self) -> None:
        """Progress the worker once; notifications that arrived are kept for `wait_notif`."""
        with self.notes_lock:
            with self.lock:
                got = self.nixl.get_new_notifs()
            for agent, msgs in got.items():
                self.notes.setdefault(str(agent), set()).update(bytes(m) for m in msgs)

    def take_notes(self, prefix: bytes) -> list[bytes]:
        """Remove and return every unread notification that starts with `prefix`."""
        out: list[bytes] = []
        with self.notes_lock:
            for msgs in self.notes.values():
                mine = {m for m in msgs if m.startswith(prefix)}
                msgs -= mine
                out.extend(mine)
        return out

    # -- memory ---------------------------------------------------------------------------
    def register(self, t: torch.Tensor) -> Region:
        t = t.view(-1)
        mem = mem_type(t)
        with self.lock:
            handle = self.nixl.register_memory([(t.data_ptr(), max(t.numel(), 1), device_id(t), "")], mem)
            self._md = None                      # the metadata now names this memory too
        return Region(t, handle, mem)

    def deregister(self, region: Region) -> None:
        with self.lock:
            self.nixl.deregister_memory(region.handle)
            self._md = None

    def metadata(self) -> bytes:
        """This agent's metadata (its name, backends and the keys of its registered memory)."""
        with self.lock:
            if self._md is None:
                self._md = bytes(self.nixl.get_agent_metadata())
            return self._md

    # -- remote agents ----------------------------------------------------------------------
    def remote(self, name: str, metadata: bytes) -> str:
        """Know agent `name` from its metadata (again when it changed: it registered memory)."""
        if not NAME_RE.match(name):
            raise PayloadError(f"nixl: agent name {name!r} is not a weightsync agent's")
        fp = hashlib.sha256(metadata).hexdigest()
        with self.lock:
            if self.remotes.get(name) == fp:
                self.remotes.move_to_end(name)
                return name
            try:          # a known agent's new metadata (it registered memory) replaces the old
                got = self.nixl.add_remote_agent(metadata)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise PayloadError(f"nixl: the metadata of agent {name} was refused by NIXL "
                                   f"({type(e).__name__}: {e})") from None
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != name:
                self._forget(got)
                raise PayloadError(f"nixl: the metadata sent as agent {name!r} is agent {got!r}'s")
            self.remotes[name] = fp
            while len(self.remotes) > MAX_REMOTES:
                self._forget(next(iter(self.remotes)))
        return name

    def _forget(self, name: str) -> None:
        self.remotes.pop(name, None)
        try:
            self.nixl.remove_remote_agent(name)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass

    # -- transfers --------------------------------------------------------------------------
    def read(self, local: torch.Tensor, peer: str, remote: list[Desc], remote_mem: str,
             notif: bytes, deadline: float, what: str) -> None:
        """READ `remote` (peer's registered memory) into `local` (registered here), then NIXL
        tells `peer` with `notif`. Raises PayloadError naming `what` and `peer` when NIXL refuses
        the descriptors, the transfer fails, or it is not done by `deadline` (monotonic)."""
        local = local.view(-1)
        with self.lock:
            try:
                lx = self.nixl.get_xfer_descs([(local.data_ptr(), local.numel(), device_id(local))],
                                              mem_type(local))
                rx = self.nixl.get_xfer_descs(remote, remote_mem)
                handle = self.nixl.initialize_xfer("READ", lx, rx, peer, notif)
            except Exception as e:  # noqa: BLE001 - NIXL's own error types
                raise PayloadError(f"nixl: {what}: agent {peer} has no registered memory at the "
                                   f"descriptors sent ({type(e).__name__}: {e}); they are forged, "
                                   f"or the memory was deregistered") from None
            try:
                state = self.nixl.transfer(handle)
            except Exception as e:  # noqa: BLE001 - NIXL's own error types
                self._release(handle)
                raise PayloadError(f"nixl: {what}: the READ from agent {peer} could not start: the "
                                   f"peer is gone or unreachable ({type(e).__name__}: {e})") from None
        wait = POLL_MIN
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise PayloadError(f"nixl: {what}: the READ from agent {peer} was not done by "
                                       f"the deadline; nothing of it was staged")
                time.sleep(wait)
                wait = min(wait * 2, POLL_MAX)
                with self.lock:
                    try:
                        state = self.nixl.check_xfer_state(handle)
                    except Exception as e:  # noqa: BLE001 - NIXL's own error types
                        state = f"{type(e).__name__}: {e}"
            if state != "DONE":
                raise PayloadError(f"nixl: {what}: the READ from agent {peer} failed (state "
                                   f"{state}): the peer died or deregistered that memory")
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        with self.lock:
            try:
                self.nixl.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001, S110 - a failed transfer may be gone already
                pass

    # -- notifications ------------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        with self.lock:
            self.nixl.send_notif(peer, message)

    def wait_notif(self, message: bytes, deadline: float) -> str | None:
        """The agent that sent `message` (consumed), or None if none did by `deadline`."""
        wait = POLL_MIN
        while True:
            self.pump()
            with self.notes_lock:
                for agent, msgs in self.notes.items():
                    if message in msgs:
                        msgs.discard(message)
                        return agent
            if time.monotonic() > deadline:
                return None
            time.sleep(wait)
            wait = min(wait * 2, POLL_MAX)

    def drop_notes(self) -> None:
        """Forget notifications nobody waited for (a sync that was abandoned)."""
        with self.notes_lock:
            self.notes.clear()


_agents: dict[str, Agent] = {}
_agents_lock = threading.Lock()


@atexit.register
def _quiesce_all() -> None:
    """Daemon threads still run while the interpreter shuts down; one inside a NIXL call when
    NIXL's objects are destroyed aborts the process ("terminate called without an active
    exception"). atexit runs before that teardown: every agent stops progressing first."""
    with _agents_lock:
        agents = [*_agents.values(), *_retired]
    for a in agents:
        a.quiesce()


_retired: list[Agent] = []       # kept alive: destroying an agent with live endpoints can abort


def fresh_agents() -> None:
    """Make every role's next `agent()` a new agent; the old ones stop progressing and stay
    alive. For a test process that runs many modules: each starts with agents of its own, as
    a real trainer or engine process does."""
    with _agents_lock:
        old = list(_agents.values())
        _agents.clear()
        _retired.extend(old)
    for a in old:
        a.quiesce()


def agent(role: str) -> Agent:
    """This process's agent for `role` ("trainer", "engine", "peer"), made on first use."""
    with _agents_lock:
        a = _agents.get(role)
        if a is None or a.name.split("-")[2] != str(os.getpid()):    # a forked child makes its own
            try:
                a = _agents[role] = Agent(role)
            except (PayloadError, ConfigError):
                raise
            except Exception as e:  # noqa: BLE001 - NIXL's or UCX's own error types
                raise TransportError(f"nixl: cannot start a NIXL agent here ({type(e).__name__}: "
                                     f"{e}); check UCX_TLS and UCX_NET_DEVICES") from None
        return a
