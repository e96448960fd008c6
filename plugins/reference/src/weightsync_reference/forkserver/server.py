"""The fork server's own process. It imports what an engine start imports, then serves requests on
a Unix socket: each names a command (`python -m module ...` or `python script.py ...`), its
environment, working directory and the three standard streams (passed as file descriptors). It
forks only when the child would run the command as a fresh interpreter would (the same Python,
no setting that a library reads as it loads changed); it answers the child's pid, and its exit
status when it ends. It holds no thread, so a fork copies no lock that another thread held."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.metadata
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any, NoReturn

__all__ = ["AT_IMPORT", "HEADER", "LAZY", "MODELS", "PRELOAD", "main", "refusal"]

# what `python -m weightsync serve` imports (about 3 s of CPU, mostly torch); plugins too
PRELOAD = ["torch", "safetensors.torch", "requests", "weightsync.cli", "weightsync_reference.server"]
# ... and what loading a transformers model imports (about 6 s of CPU more): the auto classes and
# the architectures of `weightsync_reference.models`' tiny models (others load in the child)
MODELS = ["llama", "qwen2", "qwen3_moe", "mixtral"]
# settings that libraries read as they load (thread pools, allocators, search paths): a start that
# changes one gets a fresh interpreter, since the fork server's libraries have loaded already
AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_", "LD_", "PYTHON", "TORCH",
             "CUDA", "NCCL", "UCX_", "HF_", "TRANSFORMERS", "VLLM", "WEIGHTSYNC_JIT")
# ... except these, read when used: inductor sets its cache directory in a process that compiled
LAZY = {"TORCHINDUCTOR_CACHE_DIR"}
HEADER = struct.Struct("!I")          # a request: its length, then JSON, the fds beside it
MAX_REQUEST = 4 << 20


def refusal(request: dict[str, Any], base_env: dict[str, str]) -> str | None:
    """Why a fork would not run `request` as a fresh interpreter would; None: it would."""
    argv, env = request["argv"], request["env"]
    if len(argv) < 2 or argv[0] != sys.executable:
        return f"another interpreter than {sys.executable}"
    if (argv[1] == "-m" and len(argv) < 3) or (argv[1].startswith("-") and argv[1] != "-m"):
        return f"interpreter options {argv[1]!r}"
    changed = sorted(k for k in set(env) | set(base_env)
                     if env.get(k) != base_env.get(k) and k.startswith(AT_IMPORT) and k not in LAZY)
    return f"it changes {', '.join(changed)}, read as libraries load" if changed else None


def _exit_code(code: object) -> int:
    """The exit status a fresh interpreter gives `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run(args: list[str]) -> int:
    """`args` as `python` runs them: `-m module ...` or `script ...`; then what its exit does."""
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):        # non-daemon threads, then atexit
        getattr(threading, "_shutdown")()
    with contextlib.suppress(BaseException):
        getattr(atexit, "_run_exitfuncs")()
    return code


def _child(request: dict[str, Any], fds: list[int], owned: list[socket.socket],
           wake: tuple[int, int]) -> NoReturn:
    """In the forked child: a new session, default signals, the request's streams, directory,
    environment and command; the fork server's sockets closed. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for s in owned:
            os.close(s.detach())
        for fd in wake:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()                       # not the fork server's random state
        code = _run(request["argv"][1:])
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request and its three file descriptors (ValueError: not a whole request)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    body = bytearray(data)
    try:
        while len(body) < HEADER.size or len(body) < HEADER.size + HEADER.unpack_from(body)[0]:
            if len(body) >= HEADER.size and HEADER.unpack_from(body)[0] > MAX_REQUEST:
                raise ValueError("request too large")
            more = conn.recv(1 << 16)
            if not more:
                raise ValueError("connection closed before a whole request")
            body += more
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} file descriptors, not 3")
        request = json.loads(body[HEADER.size:])
        env = request.get("env") if isinstance(request, dict) else None
        if not (isinstance(env, dict) and _strings(request.get("argv"))
                and _strings([*env, *env.values()]) and isinstance(request.get("cwd"), str)):
            raise ValueError("a request is {argv: [str], env: {str: str}, cwd: str}")
        return request, list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _strings(items: Any) -> bool:
    """Whether `items` is a list of strings."""
    return isinstance(items, list) and all(isinstance(i, str) for i in items)


def _send(conn: socket.socket, message: dict[str, Any]) -> bool:
    """Whether `message` went out (False: the client is gone)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        return False
    return True


def _serve(conn: socket.socket, listener: socket.socket, wake: tuple[int, int],
           children: dict[int, socket.socket], base_env: dict[str, str]) -> None:
    """One connection: refuse, or fork and answer the pid (the connection then waits for the
    child's exit status)."""
    try:
        conn.settimeout(10)
        request, fds = _receive(conn)
    except (OSError, ValueError):
        conn.close()
        return
    try:
        why = refusal(request, base_env)
        if why is not None:
            _send(conn, {"refused": why})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, [listener, conn, *children.values()], wake)
        children[pid] = conn
        if not _send(conn, {"pid": pid}):       # the client gave up (and may start it afresh)
            os.kill(pid, signal.SIGKILL)
    finally:
        for fd in fds:
            os.close(fd)


def _reap(children: dict[int, socket.socket]) -> None:
    """Every child that ended: its exit status (as Popen's returncode) to its connection."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def _warm_transformers() -> None:
    """transformers' auto classes and `MODELS`, where transformers is installed (without it an
    engine serves weights only); what fails to import here is imported again in the child."""
    try:
        importlib.import_module("transformers").AutoModelForCausalLM  # noqa: B018 - a lazy import
    except ImportError:
        return
    for arch in MODELS:
        with contextlib.suppress(ImportError):
            importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")


def _die_with_parent() -> None:
    """SIGTERM when the process that started the fork server is gone (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)     # PR_SET_PDEATHSIG


def main(args: list[str]) -> int:
    """Preload, then serve on the socket path `args[0]` until SIGTERM; then kill what it forked
    that still runs (a test's leftovers), each with its process group."""
    if len(args) != 1:
        print("usage: python -m weightsync_reference.forkserver SOCKET", file=sys.stderr)
        return 2
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:
        return 1
    for name in PRELOAD:
        importlib.import_module(name)
    _warm_transformers()
    for ep in importlib.metadata.entry_points(group="weightsync"):
        with contextlib.suppress(Exception):        # a broken plugin fails in the child, as before
            ep.load()
    if threading.active_count() != 1:
        print(f"the imports started {threading.active_count() - 1} threads: a fork would copy "
              "their locks; not serving", file=sys.stderr)
        return 1
    base_env = dict(os.environ)
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(args[0])
        listener.listen(64)
        while True:
            ready, _, _ = select.select([listener.fileno(), wake[0]], [], [])
            if wake[0] in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake[0], 512):
                        pass
                _reap(children)
            if listener.fileno() in ready:
                conn, _ = listener.accept()
                _serve(conn, listener, wake, children, base_env)
    finally:
        for pid in children:        # left running by their starters: they end with the server
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(args[0])
