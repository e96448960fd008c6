"""The fork server (weightsync_reference.forkserver): a start it forks runs as a fresh interpreter
would (argv, environment, directory, streams, session, exit status, signals), a start it cannot
run that way gets a fresh process, and bad requests or a dead fork server lose no start."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync.testing.waiting import wait_for
from weightsync_reference.forkserver import ENV, ForkedProcess, popen, serving
from weightsync_reference.forkserver.server import MODELS
from weightsync_reference.processes import EngineProcess

PROBE = '''
import json, os, random, signal, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "probe": os.environ.get("PROBE"), "session": os.getsid(0) == os.getpid(),
                  "stdin": sys.stdin.read(), "random": random.random()}), flush=True)
how = os.environ.get("EXIT", "0")
if how == "raise":
    raise RuntimeError("boom from the probe")
if how == "group":                       # a worker in its process group, then wait
    import subprocess
    kid = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    print(json.dumps({"kid": kid.pid}), flush=True)
    signal.pause()
if how == "pause":
    signal.pause()
sys.exit(int(how))
'''


@pytest.fixture(scope="module")
def forks():
    with serving() as path:
        assert path is not None, "the fork server did not come up"
        yield path


def start(tmp: Path, name: str, spawn=popen, argv=None, **env: str) -> tuple[subprocess.Popen, Path]:
    """The probe (or `argv`) with its output in tmp/name.log, started by `spawn`."""
    script = tmp / "probe.py"
    if not script.exists():         # once: a rewrite could truncate it under a running start
        script.write_text(PROBE)
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = spawn(argv or [sys.executable, str(script), "a b", "--c"], stdout=out,
                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(tmp),
                     env={**os.environ, **env}, start_new_session=True)
    return proc, log


def report(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_start_runs_as_a_fresh_interpreter_would(forks, tmp_path):
    forked, flog = start(tmp_path, "forked", PROBE="x")
    fresh, plog = start(tmp_path, "fresh", spawn=subprocess.Popen, PROBE="x")
    again, alog = start(tmp_path, "again", PROBE="x")
    assert type(forked) is ForkedProcess and type(fresh) is subprocess.Popen
    assert forked.wait(60) == fresh.wait(60) == again.wait(60) == 0
    got, want = report(flog), report(plog)
    assert got.pop("random") != report(alog)["random"]      # each fork reseeds
    want.pop("random")
    assert got == want and got["argv"][1:] == ["a b", "--c"] and got["session"], got
    m = [sys.executable, "-m", "json.tool", "--sort-keys", str(tmp_path / "in.json")]
    (tmp_path / "in.json").write_text('{"b": 1, "a": 2}')
    forked, flog = start(tmp_path, "m-forked", argv=m)
    fresh, plog = start(tmp_path, "m-fresh", spawn=subprocess.Popen, argv=m)
    assert type(forked) is ForkedProcess and forked.wait(60) == fresh.wait(60) == 0
    assert flog.read_text() == plog.read_text() == '{\n    "a": 2,\n    "b": 1\n}\n'


def test_a_fork_holds_the_model_code_an_engine_would_import(forks, tmp_path):
    """An engine loading a tiny transformers model imports nothing in a fork (a fresh start spent
    about 6 s of CPU on it); a fresh interpreter imported none of it yet."""
    script = tmp_path / "loaded.py"
    script.write_text("import json, sys\nprint(json.dumps(sorted(m for m in sys.modules "
                      "if m.startswith('transformers.models.') and m.count('.') == 3)))\n")
    argv = [sys.executable, str(script)]
    forked, flog = start(tmp_path, "forked", argv=argv)
    fresh, plog = start(tmp_path, "fresh", spawn=subprocess.Popen, argv=argv)
    assert type(forked) is ForkedProcess and forked.wait(60) == fresh.wait(60) == 0
    assert {f"transformers.models.{a}.modeling_{a}" for a in MODELS} <= set(report(flog))
    assert report(plog) == []


@pytest.mark.parametrize("how, code", [("3", 3), ("300", 300 & 0xFF), ("raise", 1)])
def test_exit_statuses_are_a_fresh_interpreters(forks, tmp_path, how, code):
    forked, flog = start(tmp_path, "forked", EXIT=how)
    fresh, plog = start(tmp_path, "fresh", spawn=subprocess.Popen, EXIT=how)
    assert type(forked) is ForkedProcess
    assert forked.wait(60) == fresh.wait(60) == code
    if how == "raise":
        assert "RuntimeError: boom from the probe" in flog.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signals_reach_the_fork_and_its_status_says_which(forks, tmp_path, sig):
    forked, log = start(tmp_path, "forked", EXIT="pause")
    assert type(forked) is ForkedProcess
    wait_for(lambda: log.read_text(), 60, "the probe's report")
    assert forked.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        forked.wait(0.2)
    os.killpg(forked.pid, sig)                    # its own session: its group is its pid
    assert forked.wait(60) == -sig and forked.poll() == -sig


@pytest.mark.parametrize("case", ["option", "interpreter", "import-time setting", "pipe",
                                  "no new session", "no fork server"])
def test_a_start_it_cannot_run_as_a_fresh_one_gets_a_fresh_process(forks, tmp_path, monkeypatch,
                                                                     case):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv, kw = [sys.executable, str(script)], {"stdin": subprocess.DEVNULL, "start_new_session": True}
    if case == "option":
        argv = [sys.executable, "-u", str(script)]
    elif case == "interpreter":
        os.symlink(sys.executable, tmp_path / "python")    # the same binary, another path
        argv = [str(tmp_path / "python"), str(script)]
    elif case == "import-time setting":
        kw["env"] = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1) + "0"}
    elif case == "no new session":
        kw["start_new_session"] = False
    elif case == "no fork server":
        monkeypatch.setenv(ENV, str(tmp_path / "nothing-listens-here"))
    kw["stdout"] = subprocess.PIPE if case == "pipe" else subprocess.DEVNULL
    proc = popen(argv, **kw)
    assert type(proc) is subprocess.Popen, case
    assert proc.wait(60) == 0
    if proc.stdout is not None:
        assert report_line(proc.stdout.read())["name"] == "__main__"
        proc.stdout.close()


def report_line(out: bytes) -> dict:
    return json.loads(out.decode().splitlines()[0])


def test_bad_requests_leave_it_serving(forks, tmp_path):
    for junk in [b"", b"\x00\x00", b"\x00\x00\x00\x05{not", b"\xff\xff\xff\xff" + b"x" * 64,
                 b"\x00\x00\x00\x02{}"]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(forks)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(30)
            assert s.recv(4096) == b"", junk          # closed, nothing forked
    for body in [b"[]", b'{"argv": "python", "env": {}, "cwd": "/"}',
                 b'{"argv": ["python"], "env": {"A": 1}, "cwd": "/"}', b'{"argv": [], "env": {}}']:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, open(os.devnull, "rb") as null:
            s.connect(forks)                      # well framed, with its three fds, wrong shape
            socket.send_fds(s, [len(body).to_bytes(4, "big") + body], [null.fileno()] * 3)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(30)
            assert s.recv(4096) == b"", body
    forked, log = start(tmp_path, "after")
    assert type(forked) is ForkedProcess and forked.wait(60) == 0 and report(log)["argv"]


def test_without_waiting_starts_go_fresh_until_it_listens_then_fork(tmp_path):
    before = os.environ.get(ENV)                      # the session's fork server, if any
    with serving(wait=False) as path:
        assert path is not None and os.environ[ENV] == path and not os.path.exists(path)
        early, elog = start(tmp_path, "early")             # it still imports: a fresh process
        assert type(early) is subprocess.Popen and early.wait(60) == 0
        assert report(elog)["name"] == "__main__"

        def listening() -> bool:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                return probe.connect_ex(path) == 0
        wait_for(listening, 120, "the fork server to listen")
        later, llog = start(tmp_path, "later")
        assert type(later) is ForkedProcess and later.wait(60) == 0
        assert report(llog)["argv"] == report(elog)["argv"]
    assert os.environ.get(ENV) == before


def test_a_start_outlives_a_dead_fork_server(tmp_path):
    with serving() as path:
        assert path is not None
        forked, log = start(tmp_path, "orphan", EXIT="pause")
        assert type(forked) is ForkedProcess
        wait_for(lambda: log.read_text(), 60, "the probe's report")
        server = int(Path(f"/proc/{forked.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGKILL)
        assert forked.poll() is None                 # the fork is alive without its server
        os.kill(forked.pid, signal.SIGTERM)
        assert forked.wait(60) == 255                # ended; its status died with the server


def test_what_runs_when_the_fork_server_stops_is_killed_with_its_group(tmp_path):
    """A start its test left running ends with the fork server's stop (SIGTERM), its process
    group too; a start that ended before is not touched."""
    with serving() as path:
        assert path is not None
        done, _ = start(tmp_path, "done")
        assert done.wait(60) == 0
        left, log = start(tmp_path, "left", EXIT="group")
        wait_for(lambda: len(log.read_text().splitlines()) > 1, 60, "the probe's worker")
        kid = json.loads(log.read_text().splitlines()[1])["kid"]
        assert left.poll() is None and os.path.exists(f"/proc/{kid}")
    assert left.wait(60) == 255 and not os.path.exists(f"/proc/{left.pid}")
    wait_for(lambda: not os.path.exists(f"/proc/{kid}"), 60, "the probe's worker to end")


def test_a_start_whose_client_gave_up_does_not_run(tmp_path):
    """The client hung up before the fork server answered (it timed out and may start the
    command afresh): the fork is killed, not left running beside the client's own start."""
    with serving() as path:
        assert path is not None
        first, log = start(tmp_path, "first", EXIT="pause")
        try:
            wait_for(lambda: log.read_text(), 60, "the probe's report")
            server = _ppid(str(first.pid))
            assert server is not None
            os.kill(server, signal.SIGSTOP)         # the request waits in the socket's queue
            try:
                body = json.dumps({"argv": [sys.executable, str(tmp_path / "probe.py")],
                                   "env": {**os.environ, "EXIT": "pause"},
                                   "cwd": str(tmp_path)}).encode()
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, \
                        open(os.devnull, "r+b") as null:
                    s.connect(path)
                    socket.send_fds(s, [len(body).to_bytes(4, "big") + body], [null.fileno()] * 3)
            finally:
                os.kill(server, signal.SIGCONT)
            # connections are served in order: once a later start is answered, the late one forked
            later, _ = start(tmp_path, "later")
            assert type(later) is ForkedProcess and later.wait(60) == 0

            def late() -> list[str]:
                return [p for p in os.listdir("/proc") if p.isdigit() and p != str(first.pid)
                        and _ppid(p) == server]
            wait_for(lambda: not late(), 60, "the late fork to be killed")
            assert first.poll() is None             # the other start runs on
        finally:
            first.kill()
        assert first.wait(60) == -signal.SIGKILL


def _ppid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_an_engine_start_forks_and_serves_bit_exact(forks, tmp_path):
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), log=tmp_path / "e.log") as e:
        assert type(e.proc) is ForkedProcess and e.holds(sd)
        e.kill()
        assert e.proc.returncode == -signal.SIGKILL
        e.start()                                    # a restart on the same port, forked again
        assert type(e.proc) is ForkedProcess and e.health()["version"] == 0 and e.holds(sd)
    assert e.proc.returncode == 0                    # SIGTERM: the engine's clean stop
